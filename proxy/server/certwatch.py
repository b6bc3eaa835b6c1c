"""Reloading TLS files that change, with --enable-ssl-refresh (vLLM's flag of that name):
a certificate rotated on disk (cert-manager renews a Secret, Kubernetes swaps its files
in place), or a CA bundle that gains or loses a CA, reaches new connections without a
restart.

Every TLS context this process makes from files is a `Reloading` context, registered
here as it is made: the listener's (`listener_context`, uvicorn's `ssl_context_factory`,
which runs in each worker process) and the client context of an https:// upstream
(proxy.server.dial.upstream_tls). The app's lifespan calls `check` every CHECK_SECONDS.
When a file's identity (inode, size, modification time: a swapped symlink changes it
too) differs from the last load, a whole new context is made from the files as they are
now, the way the first was made; if that fails (a rotation caught half-way: a new
certificate beside the old key) the context in use stays and the files are tried again
when they change again. Connections already open keep the context they began with.

A new context rather than loading the files into the one in use: OpenSSL's
load_verify_locations only adds to what a context trusts, so a CA taken out of a bundle
(one that signed a leaked client certificate) would stay trusted until a restart.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["CHECK_SECONDS", "WATCH", "CertWatch", "Reloading", "listener_context"]

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


class Reloading(ssl.SSLContext):
    """The context handed to uvicorn, asyncio, httpx and aiohttp: every TLS connection
    they open is made by `wrap_bio` or `wrap_socket` (asyncio's and uvloop's SSL protocol,
    anyio's TLS stream, a blocking socket), which here use `current`, the context made
    from the files at the last reload. This one holds no certificate or CA itself.

    Each connection is made by `current` itself, not moved to it during the handshake
    (an sni_callback setting `ssl_object.context`): a moved connection keeps its first
    context's session cache and ticket keys, so a client whose CA was taken out of the
    bundle could still resume a session from before the reload, unchecked."""

    def __new__(cls, current: ssl.SSLContext) -> Reloading:
        return super().__new__(cls, current.protocol)

    def __init__(self, current: ssl.SSLContext) -> None:
        self.current = current
        self._alpn: list[str] | None = None

    def replace(self, fresh: ssl.SSLContext) -> None:
        """New connections from now on are made by `fresh`."""
        if self._alpn is not None:
            fresh.set_alpn_protocols(self._alpn)
        self.current = fresh

    def set_alpn_protocols(self, alpn_protocols: Iterable[str]) -> None:
        # httpcore sets its ALPN list on the context it is given before each connect
        self._alpn = list(alpn_protocols)
        self.current.set_alpn_protocols(self._alpn)

    def wrap_socket(
        self,
        sock: socket.socket,
        server_side: bool = False,
        do_handshake_on_connect: bool = True,
        suppress_ragged_eofs: bool = True,
        server_hostname: str | bytes | None = None,
        session: ssl.SSLSession | None = None,
    ) -> ssl.SSLSocket:
        return self.current.wrap_socket(
            sock, server_side, do_handshake_on_connect, suppress_ragged_eofs,
            server_hostname, session,
        )  # fmt: skip

    def wrap_bio(
        self,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
        server_side: bool = False,
        server_hostname: str | bytes | None = None,
        session: ssl.SSLSession | None = None,
    ) -> ssl.SSLObject:
        return self.current.wrap_bio(incoming, outgoing, server_side, server_hostname, session)


@dataclass
class _Watched:
    context: weakref.ref[Reloading]  # a context nobody uses any more drops out
    paths: tuple[str, ...]  # the files `make` reads
    make: Callable[[], ssl.SSLContext]  # a new context from the files as they are now
    loaded: Identity  # the files' identity at the last load
    failed: Identity | None = None  # the identity a load last failed at (logged once)


class CertWatch:
    """The TLS contexts of this process made from files, and their reloads."""

    def __init__(self) -> None:
        self._watched: list[_Watched] = []

    def watched(
        self, make: Callable[[], ssl.SSLContext], paths: tuple[str | None, ...]
    ) -> ssl.SSLContext:
        """The context `make` makes, made again when one of `paths` (None: not given)
        changes; `make`'s own when it reads no file (the system's bundle is not watched)."""
        files = tuple(p for p in paths if p is not None)
        loaded = _identity(files)  # before the files are read: a change meanwhile is seen
        context = make()
        if not files:
            return context
        reloading = Reloading(context)
        self._watched = [w for w in self._watched if w.context() is not None]
        self._watched.append(_Watched(weakref.ref(reloading), files, make, loaded))
        return reloading

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
                fresh = watched.make()  # whole and matching, or nothing
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
            context.replace(fresh)
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
    """uvicorn's `ssl_context_factory`: its own context (`default`, which reads the files
    and applies --ssl-cert-reqs, --ssl-ciphers and ALPN), made again on each reload."""
    return WATCH.watched(default, (config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs))
