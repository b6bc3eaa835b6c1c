"""The wire's upstream side: keep-alive connections to the backend and the per-chunk path.

`UpstreamConnection` is one connection, parsing responses with llhttp (httptools). Each
upstream read is handled in `data_received`, in one callback: the parser calls `on_body`
for each body piece, which writes it to the client's transport at once (re-framed for
the client) and then hands it to the exchange with the time of the read. No task, no
await, no ASGI message per chunk. Backpressure is the transports': a full client buffer
pauses reading this connection (`pause`/`resume`, driven by the client's
`pause_writing`/`resume_writing`).

`Pool` keeps idle connections, newest first, and drops one idle longer than
`KEEPALIVE_SECONDS` (uvicorn, vLLM's server, closes them after 5 s; reusing one it just
closed fails a request). A connection goes back only after a response that ended cleanly
and that the upstream will keep alive; one that carried an abandoned, broken or
unfinished response is closed.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from time import monotonic, perf_counter
from typing import Protocol
from urllib.parse import urlsplit

import httptools

from proxy.server.headers import Headers
from proxy.server.upstream import KEEPALIVE_SECONDS


class WireRequest(Protocol):
    """What a connection tells the request it carries (proxy/server/wire/connection.py)."""

    def response_head(self, status: int, headers: Headers, now: float) -> None: ...
    def response_end(self, now: float, reusable: bool) -> None: ...
    def upstream_lost(self, exc: Exception | None) -> None: ...
    def upstream_broke(self, exc: BaseException) -> None: ...
    def client_flow(self, *, pause: bool) -> None: ...


def _discard(data: bytes) -> None:
    pass


def _ignore(chunk: bytes, now: float) -> None:
    pass


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection to the backend; carries one exchange at a time."""

    __slots__ = (
        "chunked",
        "feed",
        "headers",
        "idle_since",
        "in_head",
        "interim",
        "lost",
        "now",
        "parser",
        "paused",
        "pool",
        "request",
        "strip",
        "transport",
        "write",
    )

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.parser = httptools.HttpResponseParser(self)
        self.request: WireRequest | None = None
        self.headers: Headers = []
        self.in_head = True
        self.interim = False  # a 1xx head: not the response yet
        self.lost = False
        self.paused = False
        self.now = 0.0
        self.idle_since = 0.0
        # The per-chunk path's parts, set by the request at the response head.
        self.write: Callable[[bytes], None] = _discard
        self.chunked = False
        self.strip: Callable[[bytes], bytes] | None = None
        self.feed: Callable[[bytes, float], None] = _ignore

    def start(self, request: WireRequest, head: bytes) -> None:
        self.request, self.headers, self.in_head, self.interim = request, [], True, False
        self.now = 0.0  # until a byte of this request's answer arrives (`answered`)
        self.transport.write(head)

    # -- the hot path: one callback per upstream read ---------------------------------

    def data_received(self, data: bytes) -> None:
        self.now = perf_counter()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            request = self.request
            self.close()
            if request is not None:
                request.upstream_broke(exc)

    def on_body(self, body: bytes) -> None:
        out = body if self.strip is None else self.strip(body)
        if out:
            self.write(b"%x\r\n%b\r\n" % (len(out), out) if self.chunked else out)
        self.feed(body, self.now)

    # -- the rest of a response -------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.in_head:  # after the head: trailers, which neither data path relays
            self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # interim (103 Early Hints...): dropped, as httpx does
            self.interim = True
            return
        self.in_head = False
        if self.request is not None:
            self.request.response_head(status, self.headers, self.now)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim, self.headers = False, []
            return
        if self.request is not None:
            self.request.response_end(self.now, self.parser.should_keep_alive())

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool.forget(self)
        if self.request is not None:
            self.request.upstream_lost(exc)

    # -- the request's side -----------------------------------------------------------

    @property
    def answered(self) -> bool:
        """A byte of the current request's answer arrived (`now` is its read's time)."""
        return self.now != 0.0

    def pause(self) -> None:
        if not self.paused and not self.lost:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and not self.lost:
            self.paused = False
            self.transport.resume_reading()

    def detach(self) -> None:
        """The response is over for the request: nothing more goes to its client."""
        self.request = None
        self.write, self.strip, self.feed = _discard, None, _ignore

    def release(self, reusable: bool) -> None:
        self.detach()
        self.resume()
        if reusable and not self.lost:
            self.pool.put(self)
        else:
            self.close()

    def close(self) -> None:
        self.detach()
        if not self.lost:
            self.transport.close()

    def pause_writing(self) -> None:  # the backend reads the request slowly
        if self.request is not None:
            self.request.client_flow(pause=True)

    def resume_writing(self) -> None:
        if self.request is not None:
            self.request.client_flow(pause=False)


class Pool:
    """The backend's address and its idle keep-alive connections."""

    def __init__(self, upstream: str, connect_timeout: float) -> None:
        parts = urlsplit(upstream)
        self.host = parts.hostname or "127.0.0.1"
        self.ssl: ssl.SSLContext | None = (
            ssl.create_default_context() if parts.scheme == "https" else None
        )
        self.port = parts.port or (443 if self.ssl is not None else 80)
        default = (parts.scheme == "https" and self.port == 443) or self.port == 80
        host = self.host if ":" not in self.host else f"[{self.host}]"
        self.authority = (
            host if default and parts.port is None else f"{host}:{self.port}"
        ).encode()
        self.connect_timeout = connect_timeout
        self.idle: list[UpstreamConnection] = []

    def take(self) -> UpstreamConnection | None:
        """The newest idle connection that is still fresh, else None."""
        idle = self.idle
        if idle:
            expired = monotonic() - KEEPALIVE_SECONDS
            while idle:
                conn = idle.pop()
                if conn.idle_since > expired and not conn.lost:
                    return conn
                conn.close()
        return None

    async def connect(self) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout):
            _, conn = await loop.create_connection(
                lambda: UpstreamConnection(self), self.host, self.port, ssl=self.ssl
            )
        return conn

    def put(self, conn: UpstreamConnection) -> None:
        conn.idle_since = monotonic()
        self.idle.append(conn)

    def forget(self, conn: UpstreamConnection) -> None:
        if conn.request is None and conn in self.idle:  # closed by the backend while idle
            self.idle.remove(conn)

    def close(self) -> None:
        idle, self.idle = self.idle, []
        for conn in idle:
            conn.close()
