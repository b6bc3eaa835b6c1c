"""Asks the upstream what it is (proxy/core/identity.py reads the answers), off the request
path: a background task at start and every --models-refresh seconds after, each round's
questions asked together and bounded by one short timeout, so a dead or slow backend never
delays start-up or a request. The answer goes to tokenprobe_backend_info."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx

from proxy.core.identity import PROBES, identify

log = logging.getLogger("tokenprobe")

#: Seconds one round of questions may take.
ASK_TIMEOUT = 3.0


async def ask_backend(client: httpx.AsyncClient, upstream: str) -> tuple[str, str]:
    """(kind, version) of the backend at `upstream`, ("unknown", "unknown") when nothing
    answers in time. Never raises for the backend's sake."""

    async def one(path: str) -> tuple[int, bytes] | None:
        try:
            response = await client.get(upstream + path, timeout=ASK_TIMEOUT)
        except httpx.HTTPError:
            return None
        return response.status_code, response.content[:65536]

    paths = [probe.path for probe in PROBES]
    try:
        async with asyncio.timeout(ASK_TIMEOUT + 0.5):
            found = await asyncio.gather(*(one(path) for path in paths))
    except TimeoutError:
        return identify({})
    return identify(dict(zip(paths, found, strict=True)))


async def keep_asking(
    client: httpx.AsyncClient, upstream: str, every: float, report: Callable[[str, str], None]
) -> None:
    """The background task: ask, report, sleep, for as long as the server runs."""
    last: tuple[str, str] | None = None
    while True:
        kind, version = await ask_backend(client, upstream)
        if (kind, version) != last:
            log.info("upstream backend: %s %s", kind, version)
            last = (kind, version)
        report(kind, version)
        await asyncio.sleep(every)
