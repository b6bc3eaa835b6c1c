"""The upstream HTTP client. What its exceptions mean is decided in proxy/core/errors.py.

httpx is the client; its transport is either httpx's own or aiohttp's (httpx-aiohttp),
chosen by `--upstream-transport` after benchmarking (see docs/performance.md).

Neither library's pool keeps a misbehaving backend's bytes from reaching the wrong request
(issue 32): aiohttp queues every response it parses on the connection, so a second
response in one read, or one that arrives while the connection sits idle, is what the
next request on it reads; h11 keeps the bytes after a response's end in its buffer for the
next cycle. So both pools are guarded here, per connection reuse and never per chunk:

- aiohttp (`_GuardedHandler`, `_GuardedConnector`): a second final response for one
  request, or any response parsed while the connection is pooled, closes it at once; a
  connection whose parser holds the start of a message when it goes idle, or when it is
  about to be reused (`is_connected`, which the connector asks before reusing one), is
  closed instead of reused.
- httpx/httpcore (`_GuardedPool`): an idle connection with bytes in h11's buffer
  (`trailing_data`) or readable bytes on its socket is closed before the pool can assign
  it (httpcore itself closes a readable idle socket; this counts it).

Each such close is counted by the `count` callback (Sinks.count_upstream_protocol_error):
tokenprobe_upstream_protocol_errors_total{kind}.

A request goes once more, on a new connection, exactly when the wire's does
(WireRequest.upstream_lost): the backend closed a reused keep-alive connection as the
request went out on it, cleanly and before any byte of answer, so it closed an idle
connection and never took the request (llama.cpp's server closes after every stream though
its head says Keep-Alive: docs/llamacpp.md). The guarded connections tell it, by raising
`ClosedUnanswered`, at no cost per request beyond a flag: aiohttp's protocol knows it was
pooled before (`_GuardedHandler`), httpcore's connection that it was open before the
request (`_GuardedConnection`). A fresh connection closed unanswered is never tried again:
the backend may have taken the request, and a POST must not run twice.
"""

from __future__ import annotations

import asyncio
import functools
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import h11
import httpcore
import httpx
import yarl
from aiohttp.client_proto import ResponseHandler
from aiohttp.helpers import _EXC_SENTINEL
from aiohttp.http_exceptions import HttpProcessingError
from httpx_aiohttp.transport import AiohttpResponseStream, AiohttpTransport
from multidict import CIMultiDict

from proxy.settings import Settings

KEEPALIVE_SECONDS = 4.0


class UpstreamProtocolError(Exception):
    """The upstream broke HTTP/1.1 on a connection, which is closed; `kind` is its label in
    tokenprobe_upstream_protocol_errors_total (proxy/sinks/metrics.py)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class ClosedUnanswered(Exception):
    """The backend closed a reused keep-alive connection before any byte of the answer to
    the request on it: `send_upstream` sends that request once more, on a new connection.
    Raised as the transport's own disconnect error (`_AiohttpClosedUnanswered`,
    `_HttpxClosedUnanswered`), so where it is not caught it means what that error means."""


class _AiohttpClosedUnanswered(ClosedUnanswered, aiohttp.ServerDisconnectedError):
    pass


class _HttpxClosedUnanswered(ClosedUnanswered, httpx.RemoteProtocolError):
    pass


def _uncounted(kind: str) -> None:
    pass


def create_client(
    settings: Settings,
    transport: httpx.AsyncBaseTransport | None = None,
    count: Callable[[str], None] = _uncounted,
) -> httpx.AsyncClient:
    """The upstream client the settings ask for; `transport`, when given, replaces the one
    --upstream-transport picks (an in-process test's scripted upstream). `count` is told
    the kind of each upstream protocol error its pools close a connection for."""
    timeout = httpx.Timeout(
        connect=settings.connect_timeout,
        read=None,  # the relay times the gaps between chunks itself (RelaySettings.idle_timeout)
        write=settings.idle_timeout,
        pool=settings.connect_timeout,
    )
    # A proxy must not queue streams behind a connection cap the backend doesn't have.
    # Idle connections are dropped before the backend drops them: uvicorn (vLLM's server)
    # closes keep-alive connections after 5 s, and reusing one it just closed fails a request.
    limits = httpx.Limits(
        max_connections=None, max_keepalive_connections=1024, keepalive_expiry=KEEPALIVE_SECONDS
    )
    if transport is None:
        transport = _transport(settings, limits, count)
    client = UpstreamClient(transport=transport, timeout=timeout, limits=limits)
    client.limits = limits
    client.count = count
    client.headers.clear()  # forward the client's headers, not httpx's defaults
    return client


def _transport(
    settings: Settings, limits: httpx.Limits, count: Callable[[str], None]
) -> httpx.AsyncBaseTransport:
    """httpx's own transport, or aiohttp's (--upstream-transport)."""
    if settings.upstream_transport == "aiohttp":

        def session() -> aiohttp.ClientSession:
            connector = _GuardedConnector(limit=0, keepalive_timeout=KEEPALIVE_SECONDS)
            connector._factory = functools.partial(  # type: ignore[assignment]
                _GuardedHandler, loop=connector._loop, count=count
            )
            client = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                # No cookie jar: one client's Set-Cookie must not go out on other clients' requests.
                cookie_jar=aiohttp.DummyCookieJar(),
                # Send exactly the client's headers: no added Accept-Encoding (the reply
                # would come compressed to a client that did not ask), User-Agent or Accept.
                # Nor a Content-Type the client did not send.
                skip_auto_headers=("Accept-Encoding", "User-Agent", "Accept", "Content-Type"),
            )
            # aiohttp sends an idempotent request again after any disconnect, on a fresh
            # connection too, and a POST never: send_upstream resends by the wire's rule
            # instead, for every method (aiohttp's test client turns it off the same way).
            client._retry_connection = False
            return client

        return AiohttpTransport(client=session)
    return guarded_httpx_transport(limits, count)


# -- aiohttp ------------------------------------------------------------------------------

_BUSY, _SETTLING, _IDLE = "busy", "settling", "idle"


class _GuardedHandler(ResponseHandler):
    """aiohttp's connection protocol, with the pool's guard (see the module's docstring)
    and failing the response body on a parse error.

    States: busy (a request's response is being read; from `set_response_params`, which
    aiohttp calls for every request on the connection), settling (released to the pool in
    this loop iteration: the rest of the read that ended the response may still be
    parsed), idle (pooled). `feed_data` is aiohttp's once-per-parsed-message call.

    A clean close before any byte of the answer on a connection that was pooled before
    (`_reused`) is raised as `ClosedUnanswered`: no message parsed for the request
    (`_heard`, a 1xx included) and none begun (aiohttp's disconnect error then carries its
    own text, not the unfinished message).

    With aiohttp's C parser, a malformed body (a chunk size that is not hex) makes the
    protocol close the connection and record the error on itself, but the response's body
    stream is never told: a reader waits for the idle timeout and the break is counted as
    upstream_timeout. (The pure-Python parser fails the body itself.)
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, count: Callable[[str], None]) -> None:
        super().__init__(loop)
        self._count = count
        self._state = _BUSY
        self._finals = 0  # final (non-1xx) responses parsed for the current request
        self._heard = False  # a response (1xx included) parsed for the current request
        self._reused = False  # pooled before: the current request is not its first
        self._faulted = False  # closed for a protocol error, counted

    def set_response_params(self, **kwargs: Any) -> None:
        self._state, self._finals, self._heard = _BUSY, 0, False
        super().set_response_params(**kwargs)

    def feed_data(self, data: Any, size: int = 0) -> None:
        if self._state is not _BUSY:  # a response no request is waiting for
            self.fault(self._unasked())
            return
        self._heard = True
        code = data[0].code
        if code == 101:  # whatever follows is another protocol: never reused
            self._should_close = True
        if code >= 200 or code == 101:
            self._finals += 1
            if self._finals > 1:  # a second response to one request: never read
                self.fault("extra_bytes")
                return
        super().feed_data(data, size)

    def pooled(self) -> None:
        """The connector put this connection in its pool (from inside the read that ended
        its response, as often as not): it is idle once this loop iteration is over."""
        self._state, self._reused = _SETTLING, True
        self._loop.call_soon(self._settle)

    def _settle(self) -> None:
        if self._state is _SETTLING:
            if self._holds_a_message_start():
                self.fault("extra_bytes")
            else:
                self._state = _IDLE

    def is_connected(self) -> bool:
        # The connector asks this of a pooled connection before reusing it.
        if self._state is not _BUSY and self._holds_a_message_start():
            self.fault(self._unasked())
        return super().is_connected()

    def _holds_a_message_start(self) -> bool:
        """Whether the parser is inside a message (its head begun, not finished). Asked
        only of a connection between requests, whose parser the next request replaces:
        `feed_eof` returns the unfinished message, or None when there is none."""
        parser = self._parser
        if parser is None or self.transport is None:
            return False
        try:
            return parser.feed_eof() is not None
        except Exception:
            return True

    def _unasked(self) -> str:
        return "idle_bytes" if self._state is _IDLE else "extra_bytes"

    def fault(self, kind: str) -> None:
        """Close the connection for breaking HTTP/1.1, and count it once."""
        self._should_close = True
        if not self._faulted:
            self._faulted = True
            self._count(kind)
        if self.transport is not None:
            self.transport.close()

    def set_exception(self, exc: BaseException, exc_cause: BaseException = _EXC_SENTINEL) -> None:
        if (
            type(exc) is aiohttp.ServerDisconnectedError  # a clean close, not a reset
            and isinstance(exc.message, str)  # no response begun
            and self._state is _BUSY
            and self._reused
            and not self._heard
        ):
            exc = _AiohttpClosedUnanswered()
        if isinstance(exc, HttpProcessingError) and not self._faulted:
            # The parser refused what came (aiohttp closed the transport already).
            self._faulted = True
            self._count("malformed" if self._state is _BUSY else self._unasked())
        payload = self._payload
        super().set_exception(exc, exc_cause)
        if payload is not None and payload.exception() is None and not payload.is_eof():
            payload.set_exception(aiohttp.ClientPayloadError(f"malformed response body: {exc}"))


class _GuardedConnector(aiohttp.TCPConnector):
    """aiohttp's connector, telling a connection when it goes into the pool."""

    def _release(self, key: Any, protocol: ResponseHandler, *, should_close: bool = False) -> None:
        super()._release(key, protocol, should_close=should_close)
        pooled = protocol.transport is not None and not self._closed  # else closed
        if pooled and isinstance(protocol, _GuardedHandler):
            protocol.pooled()


# -- httpx (httpcore) ---------------------------------------------------------------------


def guarded_httpx_transport(
    limits: httpx.Limits, count: Callable[[str], None] = _uncounted
) -> httpx.AsyncHTTPTransport:
    """httpx's own transport, on a pool that closes dirty idle connections."""
    transport = _GuardedHTTPTransport(count, limits=limits)
    old = transport._pool
    transport._pool = _GuardedPool(
        count,
        ssl_context=old._ssl_context,
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry,
    )
    return transport


class _GuardedHTTPTransport(httpx.AsyncHTTPTransport):
    """httpx's transport, refusing what the other paths' parsers refuse and counting it.

    h11 takes a response with both Content-Length and Transfer-Encoding by the chunks
    (RFC 9112 §6.3 allows it, and says it "ought to be handled as an error"); llhttp and
    aiohttp refuse it, so here it is refused too. h11 refuses an unasked 101 itself
    (a server switch with no pending proposal, h11/_state.py), as a RemoteProtocolError."""

    def __init__(self, count: Callable[[str], None], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._count = count

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            response = await super().handle_async_request(request)
        except httpx.RemoteProtocolError as exc:
            text = str(exc)
            if "disconnected" not in text:  # the backend closing is no protocol error
                self._count("upgrade" if "SWITCH" in text else "malformed")
            raise
        headers = response.headers
        if "transfer-encoding" in headers and "content-length" in headers:
            self._count("malformed")
            await response.aclose()  # unread: httpcore closes the connection
            raise UpstreamProtocolError(
                "malformed", "the upstream sent Content-Length and Transfer-Encoding together"
            )
        return response


class _GuardedPool(httpcore.AsyncConnectionPool):
    """httpcore's pool, expiring an idle HTTP/1.1 connection that holds bytes no request
    asked for, before it assigns connections to requests (once per request added or
    finished, as httpcore's own expiry check runs)."""

    def __init__(self, count: Callable[[str], None], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._count = count

    def _assign_requests_to_connections(self) -> list[httpcore.AsyncConnectionInterface]:
        for connection in self._connections:
            inner = getattr(connection, "_connection", None)
            if isinstance(inner, httpcore.AsyncHTTP11Connection) and inner.is_idle():
                kind = _idle_dirt(inner)
                if kind is not None:
                    self._count(kind)
                    inner._expire_at = 0.0  # has_expired(): httpcore closes it below
        return super()._assign_requests_to_connections()

    def create_connection(self, origin: httpcore.Origin) -> httpcore.AsyncConnectionInterface:
        # httpcore's own (a pool with no proxy), as the connection that tells a reused
        # one closed unanswered.
        return _GuardedConnection(
            origin=origin,
            ssl_context=self._ssl_context,
            keepalive_expiry=self._keepalive_expiry,
            http1=self._http1,
            http2=self._http2,
            retries=self._retries,
            local_address=self._local_address,
            uds=self._uds,
            network_backend=self._network_backend,
            socket_options=self._socket_options,
        )


class _GuardedConnection(httpcore.AsyncHTTPConnection):
    """httpcore's connection, raising `ClosedUnanswered` for a request that found it open
    (connected for an earlier request) and that the backend closed cleanly before any
    byte of the answer: h11 still waits for the response head and holds no byte of one.
    A 1xx then the close looks the same here (h11 keeps no trace of it); the wire and
    the aiohttp transport count a 1xx as an answer."""

    async def handle_async_request(self, request: httpcore.Request) -> httpcore.Response:
        reused = self._connection is not None
        try:
            return await super().handle_async_request(request)
        except httpcore.RemoteProtocolError as exc:
            inner = self._connection
            if (
                reused
                and isinstance(inner, httpcore.AsyncHTTP11Connection)
                and inner._h11_state.their_state is h11.SEND_RESPONSE
                and not inner._h11_state.trailing_data[0]
            ):
                # httpx passes this on as it is: it is no httpcore error to translate.
                raise _HttpxClosedUnanswered(str(exc)) from exc
            raise


def _idle_dirt(conn: httpcore.AsyncHTTP11Connection) -> str | None:
    if conn._h11_state.trailing_data[0]:  # read with the last response, after its end
        return "extra_bytes"
    stream = conn._network_stream
    if not stream.get_extra_info("is_readable"):
        return None
    sock = stream.get_extra_info("socket")  # asyncio's TransportSocket: no recv of its own
    try:  # readable: bytes, or the backend's close (b""), which is no error
        with socket.fromfd(sock.fileno(), socket.AF_INET, socket.SOCK_STREAM) as peek:
            return "idle_bytes" if peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) else None
    except (OSError, AttributeError):
        return None


class UpstreamClient(httpx.AsyncClient):
    """httpx's client, keeping a handle on its transport for `send` below."""

    def __init__(self, *, transport: httpx.AsyncBaseTransport, **kwargs: object) -> None:
        super().__init__(transport=transport, **kwargs)  # type: ignore[arg-type]
        self.upstream_transport = transport
        self.limits = httpx.Limits()
        self.count: Callable[[str], None] = _uncounted
        self._bytes_transport: httpx.AsyncHTTPTransport | None = None
        self._fresh_transport: httpx.AsyncHTTPTransport | None = None

    def bytes_transport(self) -> httpx.AsyncBaseTransport:
        """httpx's own transport, for requests aiohttp cannot send byte for byte."""
        if isinstance(self.upstream_transport, httpx.AsyncHTTPTransport):
            return self.upstream_transport
        if self._bytes_transport is None:
            self._bytes_transport = guarded_httpx_transport(self.limits, self.count)
        return self._bytes_transport

    def fresh_transport(self) -> httpx.AsyncBaseTransport:
        """httpx's own transport, on a new connection for each request, kept by none
        (httpcore closes an idle connection beyond max_keepalive_connections): where a
        request goes once more after a kept-alive connection closed unanswered."""
        if self._fresh_transport is None:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
            self._fresh_transport = guarded_httpx_transport(limits, self.count)
        return self._fresh_transport

    async def aclose(self) -> None:
        await super().aclose()
        for transport in (self._bytes_transport, self._fresh_transport):
            if transport is not None:
                await transport.aclose()


async def send_upstream(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
) -> httpx.Response:
    """Send one proxied request; the response comes back with its body unread.

    It goes straight to the transport: a reverse proxy needs none of the client's
    per-request layers (auth flow, redirects, event hooks, an INFO log line, the cookie
    jar), which cost more CPU than the rest of the request. The cookie jar would even be
    wrong here: it would replay one client's Set-Cookie on every later client's request.

    `url` is sent exactly: its path is already normalised (proxy.core.paths), and neither
    client may normalise or re-encode it again. Header values go out byte for byte.

    A request the backend never took, on a kept-alive connection it closed
    (`ClosedUnanswered`), goes once more on a new connection, through httpx's transport
    whichever transport sent it first: `body` is the whole body, read before, so it goes
    again byte for byte. The caller's first-byte timeout covers both.
    """
    # The relay times the gaps between chunks itself (proxy.server.exchange.IdleTimer): a transport's
    # read timeout would cost a timer per chunk, and would also cut the wait for the
    # response headers, which first_byte_timeout governs.
    timeout = {**client.timeout.as_dict(), "read": None}
    if not isinstance(client, UpstreamClient):
        request = httpx.Request(method, url, headers=headers, content=body)
        return await client.send(request, stream=True)
    transport = client.upstream_transport
    try:
        if isinstance(transport, AiohttpTransport):
            text_headers = _utf8_headers(headers)
            if text_headers is not None:
                return await _send_aiohttp(transport, method, url, text_headers, body, timeout)
            # aiohttp writes header values as UTF-8 text: other bytes go through httpcore,
            # which writes them as they are.
            transport = client.bytes_transport()
        return await _send_httpx(transport, method, url, headers, body, timeout)
    except ClosedUnanswered:
        return await _send_httpx(client.fresh_transport(), method, url, headers, body, timeout)


async def _send_httpx(
    transport: httpx.AsyncBaseTransport,
    method: str,
    url: str,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    timeout: dict[str, float | None],
) -> httpx.Response:
    request = httpx.Request(
        method, url, headers=headers, content=body, extensions={"timeout": timeout}
    )
    # httpx.URL removes dot segments and re-quotes; httpcore sends this target instead.
    request.extensions["target"] = _request_target(url)
    response = await transport.handle_async_request(request)
    response.request = request
    return response


def _request_target(url: str) -> bytes:
    after_scheme = url.partition("//")[2]
    slash = after_scheme.find("/")
    return after_scheme[slash:].encode("ascii") if slash >= 0 else b"/"


def _utf8_headers(headers: list[tuple[bytes, bytes]]) -> CIMultiDict[str] | None:
    out: CIMultiDict[str] = CIMultiDict()
    try:
        for name, value in headers:
            out.add(name.decode("latin-1"), value.decode("utf-8"))
    except UnicodeDecodeError:
        return None
    return out


async def _send_aiohttp(
    transport: AiohttpTransport,
    method: str,
    url: str,
    headers: CIMultiDict[str],
    body: bytes,
    timeout: dict[str, float | None],
) -> httpx.Response:
    """httpx-aiohttp's request, minus what changes the wire: it hands aiohttp the URL as
    text (yarl then normalises and re-quotes it) and headers httpx decoded with one
    guessed encoding for all of them."""
    if not isinstance(transport.client, aiohttp.ClientSession):
        transport.client = transport.get_client()
    session = transport.client
    response = await session.request(
        method,
        yarl.URL(url, encoded=True),
        headers=headers,
        data=body or None,
        allow_redirects=False,
        auto_decompress=False,
        compress=False,
        timeout=aiohttp.ClientTimeout(
            sock_connect=timeout.get("connect"), connect=timeout.get("pool")
        ),
    ).__aenter__()
    return httpx.Response(
        status_code=response.status,
        headers=response.raw_headers,
        stream=AiohttpResponseStream(response),
        extensions={"http_version": b"HTTP/1.1"},
    )


def body_reader(response: httpx.Response) -> Callable[[], Awaitable[bytes]]:
    """A coroutine function giving the next raw chunk of the body on each call, b"" at its end.

    With the aiohttp transport it reads aiohttp's stream itself: httpx would pass each
    chunk through three more async iterators for the same bytes. aiohttp's errors then
    arrive unwrapped, and `proxy.core.errors.classify_exception` knows them.
    """
    inner = getattr(response.stream, "_aiohttp_response", None)  # httpx-aiohttp's stream
    if isinstance(inner, aiohttp.ClientResponse):
        return inner.content.readany
    chunks = response.aiter_raw()

    async def read() -> bytes:
        return await anext(chunks, b"")

    return read
