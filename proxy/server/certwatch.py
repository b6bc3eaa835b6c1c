"""Reloading TLS files that change, with --enable-ssl-refresh (vLLM's flag of that name):
a certificate rotated on disk (cert-manager renews a Secret, Kubernetes swaps its files
in place) reaches new connections without a restart.

Every TLS context this process makes from files is registered here as it is made: the
listener's (`listener_context`, uvicorn's `ssl_context_factory`, which runs in each worker
process) and each client context of an https:// upstream (proxy.server.dial.upstream_tls).
The app's lifespan calls `check` every CHECK_SECONDS. When a file's identity (inode,
size, modification time: a swapped symlink changes it too) differs from the last load,
the files are loaded into a scratch context first, so a rotation caught half-way (a new
certificate beside the old key) is left for the next check while the live context keeps
what it has; then into the live context, which connections already open do not notice
and new handshakes use. A CA bundle adds its certificates to those the context trusts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["CHECK_SECONDS", "WATCH", "CertWatch", "listener_context"]

log = logging.getLogger(__name__)

CHECK_SECONDS = 1.0

Identity = tuple[tuple[int, int, int] | None, ...]


def _identity(paths: tuple[str, ...]) -> Identity:
    found: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            found.append(None)  # gone for the moment (a swap in progress)
        else:
            found.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(found)


@dataclass
class _Watched:
    context: weakref.ref[ssl.SSLContext]  # a context nobody uses any more drops out
    certfile: str | None
    keyfile: str | None
    cafile: str | None
    server: bool  # the listener's: its scratch context is a server's
    loaded: Identity  # the files' identity at the last load
    failed: Identity | None = None  # the identity a load last failed at (logged once)

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(p for p in (self.certfile, self.keyfile, self.cafile) if p is not None)

    def load_into(self, context: ssl.SSLContext) -> None:
        if self.certfile is not None:
            context.load_cert_chain(self.certfile, self.keyfile)
        if self.cafile is not None:
            context.load_verify_locations(cafile=self.cafile)


class CertWatch:
    """The TLS contexts of this process made from files, and their reloads."""

    def __init__(self) -> None:
        self._watched: list[_Watched] = []

    def add(
        self,
        context: ssl.SSLContext,
        certfile: str | None,
        keyfile: str | None,
        cafile: str | None,
        *,
        server: bool,
    ) -> None:
        if certfile is None and cafile is None:
            return  # nothing from a file: the system's bundle is not watched
        watched = _Watched(weakref.ref(context), certfile, keyfile, cafile, server, ())
        watched.loaded = _identity(watched.paths)
        self._watched = [w for w in self._watched if w.context() is not None]
        self._watched.append(watched)

    def check(self) -> tuple[int, int]:
        """Reload what changed; (contexts reloaded, reloads that failed this time)."""
        loaded = failed = 0
        for watched in self._watched:
            context = watched.context()
            if context is None:
                continue
            now = _identity(watched.paths)
            if now == watched.loaded or now == watched.failed:
                continue
            try:
                protocol = ssl.PROTOCOL_TLS_SERVER if watched.server else ssl.PROTOCOL_TLS_CLIENT
                watched.load_into(ssl.SSLContext(protocol))  # whole and matching, or nothing
                watched.load_into(context)
            except (OSError, ssl.SSLError) as exc:
                watched.failed = now
                failed += 1
                log.warning(
                    "TLS files %s changed but do not load (%s): kept the ones before; "
                    "retried when they change again",
                    ", ".join(watched.paths),
                    exc,
                )
                continue
            watched.loaded, watched.failed = now, None
            loaded += 1
            log.info("TLS files reloaded: %s", ", ".join(watched.paths))
        return loaded, failed

    async def run(self, count: Callable[[str], None], every: float = CHECK_SECONDS) -> None:
        """Check every `every` seconds; `count` is told "loaded" or "failed" per reload."""
        while True:
            await asyncio.sleep(every)
            loaded, failed = self.check()
            for _ in range(loaded):
                count("loaded")
            for _ in range(failed):
                count("failed")


#: This process's contexts: they are made where uvicorn and the data paths make them.
WATCH = CertWatch()


def listener_context(config: Any, default: Callable[[], ssl.SSLContext]) -> ssl.SSLContext:
    """uvicorn's `ssl_context_factory`: its own context, registered for reloads."""
    context = default()
    WATCH.add(context, config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs, server=True)
    return context
