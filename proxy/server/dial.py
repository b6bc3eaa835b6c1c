"""Opening a connection to the upstream: to its host and port, or to the Unix socket of
`--upstream-uds` (`UpstreamURL.uds`, a vLLM started with `--uds`).

The wire's pool and the WebSocket tunnel open theirs here; the ASGI relay's clients are
given the socket by their own means (proxy/server/upstream.py). Over a Unix socket TLS
still checks the URL's host, as curl's --unix-socket does with an https:// URL.

Every client of an https:// upstream (the wire's pool, the tunnel, the ASGI relay's httpx
and aiohttp transports, the /v1/models and identity calls) uses the one TLS context
`upstream_tls` makes, so they trust the same CAs and present the same client certificate.
"""

from __future__ import annotations

import asyncio
import functools
import os
import ssl as ssl_module
from collections.abc import Callable
from typing import Protocol, TypeVar

import httpx

from proxy.core.errors import ConnectFailed, ConnectTimedOut
from proxy.core.upstream_url import UpstreamURL
from proxy.server.certwatch import WATCH

__all__ = [
    "client_tls",
    "connect_unix",
    "dial",
    "httpx_default_tls",
    "name_the_socket",
    "upstream_tls",
    "where",
]

P = TypeVar("P", bound=asyncio.BaseProtocol)


class UpstreamTLSSettings(Protocol):
    """The settings `upstream_tls` reads (Settings, and the groups that copy them)."""

    @property
    def upstream(self) -> str: ...
    @property
    def upstream_ca_certs(self) -> str | None: ...
    @property
    def upstream_ssl_certfile(self) -> str | None: ...
    @property
    def upstream_ssl_keyfile(self) -> str | None: ...


def upstream_tls(settings: UpstreamTLSSettings) -> ssl_module.SSLContext | None:
    """The TLS context for an https:// upstream, None for http://: the system's CAs (or
    SSL_CERT_FILE's, which OpenSSL reads), or --upstream-ca-certs in their place, and the
    client certificate of --upstream-ssl-certfile when given (mutual TLS). The wire's pool,
    the tunnel and the ASGI relay's client each ask for it; they get the one context."""
    if not UpstreamURL.parse(settings.upstream).tls:  # https, in any case
        return None
    return _tls(
        settings.upstream_ca_certs,
        settings.upstream_ssl_certfile,
        settings.upstream_ssl_keyfile,
        (os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR")),
    )


@functools.lru_cache(maxsize=8)
def _tls(
    cafile: str | None,
    certfile: str | None,
    keyfile: str | None,
    openssl_env: tuple[str | None, str | None],  # read by OpenSSL as the context is made
) -> ssl_module.SSLContext:
    # made again when the files change, with --enable-ssl-refresh: a CA taken out of
    # --upstream-ca-certs is no longer trusted for new connections (proxy/server/certwatch.py)
    make = functools.partial(client_tls, cafile, certfile, keyfile)
    return WATCH.watched(make, (cafile, certfile, keyfile))


def client_tls(
    cafile: str | None, certfile: str | None, keyfile: str | None
) -> ssl_module.SSLContext:
    """A client context from the files as they are now: `cafile`'s CAs (the system's when
    None) and the client certificate of `certfile` and `keyfile` when given."""
    context = ssl_module.create_default_context(cafile=cafile)
    if certfile is not None:
        context.load_cert_chain(certfile, keyfile)
    return context


@functools.cache
def httpx_default_tls() -> ssl_module.SSLContext:
    """httpx's default context, made once, for a transport that must be handed one and
    will not use it: an http:// upstream's, or httpx-aiohttp's, whose session brings its
    own. Left to make its own, httpx reads certifi's CAs anew for each transport: 21 ms
    of CPU, in each ASGI relay's start and again for each transport made later."""
    return httpx.create_ssl_context()


async def dial(
    loop: asyncio.AbstractEventLoop,
    factory: Callable[[], P],
    upstream: UpstreamURL,
    ssl: ssl_module.SSLContext | None,
    timeout: float | None = None,
) -> tuple[asyncio.Transport, P]:
    """A connection to the upstream within `timeout` seconds (--connect-timeout), else
    `ConnectTimedOut`, which names the setting and the address, as every path says it;
    or `ConnectFailed` from what the system said (the system's own timeout stays a
    TimeoutError)."""
    if timeout is None:
        return await _dial(loop, factory, upstream, ssl)
    try:
        async with asyncio.timeout(timeout) as deadline:
            return await _dial(loop, factory, upstream, ssl)
    except TimeoutError as exc:
        if not deadline.expired():
            raise
        raise ConnectTimedOut(timeout, where(upstream.host, upstream.port, upstream.uds)) from exc


def where(host: str, port: int, uds: str | None = None) -> str:
    """The address a connect tried, as every path's record names it after a failed or
    timed-out connect: "host 10.0.0.5:8000", which the client's answer leaves out
    (proxy.core.errors.relay_failure), or "socket /run/vllm.sock" (--upstream-uds)."""
    if uds is not None:
        return f"socket {uds}"
    return f"host [{host}]:{port}" if ":" in host else f"host {host}:{port}"


async def _dial(
    loop: asyncio.AbstractEventLoop,
    factory: Callable[[], P],
    upstream: UpstreamURL,
    ssl: ssl_module.SSLContext | None,
) -> tuple[asyncio.Transport, P]:
    try:
        name = upstream.server_name if ssl else None
        if upstream.uds is None:
            return await loop.create_connection(
                factory, upstream.host, upstream.port, ssl=ssl, server_hostname=name
            )
        return await connect_unix(loop, factory, upstream.uds, ssl=ssl, server_hostname=name)
    except TimeoutError:
        raise
    except OSError as exc:
        if upstream.uds is not None:
            name_the_socket(exc, upstream.uds)  # which names it: no `where` after
            raise ConnectFailed(str(exc)) from exc
        raise ConnectFailed(str(exc), where(upstream.host, upstream.port)) from exc


#: The pauses between a Unix socket's connects while its listener's backlog is full: the
#: first, and the most one grows to (doubling).
FULL_BACKLOG_PAUSES = (0.005, 0.1)


async def connect_unix(
    loop: asyncio.AbstractEventLoop,
    factory: Callable[[], P],
    path: str,
    ssl: ssl_module.SSLContext | None = None,
    server_hostname: str | None = None,
) -> tuple[asyncio.Transport, P]:
    """A connection to the Unix socket at `path`, waiting while its listener's backlog is
    full, until the caller's timeout (--connect-timeout) cancels it.

    A full backlog is a listener that is not accepting yet: a TCP connect to one waits
    (the kernel drops the SYN, the client sends it again) until its timeout, a 504; a
    non-blocking Unix connect fails at once with EAGAIN (a BlockingIOError), which
    asyncio passes on, and which told the client 502 upstream_unreachable on the wire and
    aiohttp where httpx, whose anyio tries again while it waits (anyio's connect_unix),
    told 504. Tried again here, the three paths and the tunnel give the connect
    timeout's 504, as for TCP and as a blocking connect would wait."""
    pause, most = FULL_BACKLOG_PAUSES
    while True:
        try:
            return await loop.create_unix_connection(
                factory, path, ssl=ssl, server_hostname=server_hostname
            )
        except BlockingIOError:
            await asyncio.sleep(pause)
            pause = min(pause * 2, most)


def name_the_socket(exc: BaseException, path: str) -> None:
    """Put the socket's path on the system's errors in `exc`'s chain (itself, its causes
    and contexts) that name no file: a refused TCP connect names its address, and a failed
    Unix one should name its socket. The ASGI relay's clients raise their own errors over
    the system's (aiohttp's are OSErrors too), so each is named (proxy/server/upstream.py)."""
    current: BaseException | None = exc
    while current is not None:
        if isinstance(current, OSError) and current.errno is not None and current.filename is None:
            current.filename = path
        current = current.__cause__ or current.__context__
