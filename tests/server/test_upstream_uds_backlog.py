"""The ASGI relay's httpx transport connecting to a Unix socket whose listener's backlog is
full (a vLLM started with --uds that is not accepting yet): it waits for
--connect-timeout, as every path does (proxy.server.dial.connect_unix), without keeping a
core busy meanwhile. anyio's connect_unix waited for the socket to be writable after each
EAGAIN, which an unconnected Unix socket always is: it tried again at once, thousands of
times a second, for the whole wait."""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpcore
import httpx
import pytest

from proxy.server.upstream import guarded_httpx_transport
from tests.backlog import full_backlog
from tests.server.conftest import no_proxy

pytestmark = no_proxy

WAIT = 1.0


@pytest.fixture
def full_unix_socket() -> Iterator[str]:
    """A listening Unix socket whose backlog is full, filled by connections it never
    accepts: a non-blocking connect to it fails with EAGAIN."""
    folder = Path(tempfile.mkdtemp(prefix="tp-uds-", dir="/tmp"))  # a socket path is short
    try:
        with full_backlog(str(folder / "full.sock"), socket.AF_UNIX) as where:
            yield str(where)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_full_backlog_is_waited_on_without_spinning(full_unix_socket: str) -> None:
    async def connect() -> BaseException:
        transport = guarded_httpx_transport(httpx.Limits(), uds=full_unix_socket)
        timeout = {"connect": WAIT, "read": None, "write": None, "pool": WAIT}
        request = httpx.Request("GET", "http://localhost/", extensions={"timeout": timeout})
        try:
            with pytest.raises(httpx.ConnectTimeout) as caught:
                await transport.handle_async_request(request)
        finally:
            await transport.aclose()
        return caught.value

    wall, cpu = time.monotonic(), time.process_time()
    error = asyncio.run(connect())
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    assert isinstance(error.__cause__, httpcore.ConnectTimeout)  # what connect_timed_out reads
    assert wall >= WAIT * 0.9, wall
    # a spinning connect took all the CPU it was given: most of the wait, even shared
    assert cpu < WAIT * 0.3, f"{cpu:.2f} s of CPU in a {wall:.2f} s connect"
