"""The ASGI relay's aiohttp transport (`--upstream-transport aiohttp`, httpx-aiohttp), with
the pool's guard that proxy/server/upstream.py's docstring describes (`_GuardedHandler`,
`_GuardedConnector`), and the request sent byte for byte through it.

A module of its own so that only a process sending through aiohttp imports aiohttp, about
0.1 s of a proxy's start: under the wire (`tokenprobe serve`'s default) the relay's client
only asks the backend's control-plane routes, on httpx's own transport
(proxy/server/serve.py).
"""

from __future__ import annotations

import asyncio
import functools
import ssl
from collections.abc import Callable
from typing import Any

import aiohttp
import httpx
import yarl
from aiohttp.client_exceptions import UnixClientConnectorError
from aiohttp.client_proto import ResponseHandler
from aiohttp.client_reqrep import ClientRequest
from aiohttp.helpers import _EXC_SENTINEL, ceil_timeout
from aiohttp.http_exceptions import ContentLengthError, HttpProcessingError, TransferEncodingError
from httpx_aiohttp.transport import AiohttpResponseStream, AiohttpTransport
from multidict import CIMultiDict

from proxy.core.errors import fault_words, parser_words
from proxy.server.backlog import close_or_reset
from proxy.server.dial import connect_unix, httpx_default_tls
from proxy.server.protocol import MAX_RESPONSE_HEAD
from proxy.server.upstream_errors import (
    ClosedInHead,
    ClosedUnanswered,
    UpstreamClosed,
    UpstreamProtocolError,
)

#: The most upstream response header lines taken: as many as fit in MAX_RESPONSE_HEAD,
#: which the relay checks once the head is parsed (forward.py), as the wire bounds a head
#: by its bytes alone (a line counts its name and value and 4 more: `header_line_bytes`).
#: aiohttp's own 128, and 512 after it, refused a 6.5 KiB head of 600 short lines the wire
#: and httpx take. A line (and a value) is bounded as a whole head is.
RESPONSE_HEADERS = MAX_RESPONSE_HEAD // 5


class _AiohttpClosedUnanswered(ClosedUnanswered, aiohttp.ServerDisconnectedError):
    pass


class _AiohttpClosedInHead(ClosedInHead, aiohttp.ServerDisconnectedError):
    """Without the unfinished message aiohttp gives its own disconnect error here (a
    RawResponseMessage's repr: the upstream's headers, about 400 characters of aiohttp's
    internals), which a client's answer must not carry."""


def aiohttp_transport(
    count: Callable[[str], None],
    keepalive: float,
    uds: str | None = None,
    tls: ssl.SSLContext | None = None,
) -> AiohttpTransport:
    """httpx-aiohttp's transport on a guarded connector; `count` is told each protocol
    error's kind, idle connections close after `keepalive` seconds; through the Unix
    socket `uds` when given (--upstream-uds), with the TLS context `tls` when given."""

    def session() -> aiohttp.ClientSession:
        # aiohttp's Unix connector speaks no TLS: the settings refuse https:// over a
        # Unix socket on this transport (proxy.settings._check_uds)
        connector: aiohttp.BaseConnector = (
            _GuardedConnector(limit=0, keepalive_timeout=keepalive, ssl=tls or True)
            if uds is None
            else _GuardedUnixConnector(uds, limit=0, keepalive_timeout=keepalive)
        )
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
            # A response head as the wire and httpx take it: aiohttp's own limits (8190
            # bytes a header line, 128 headers) made a backend's long Link header a 502.
            max_line_size=MAX_RESPONSE_HEAD,
            max_field_size=MAX_RESPONSE_HEAD,
            max_headers=RESPONSE_HEADERS,
        )
        # aiohttp sends an idempotent request again after any disconnect, on a fresh
        # connection too, and a POST never: send_upstream resends by the wire's rule
        # instead, for every method (aiohttp's test client turns it off the same way).
        client._retry_connection = False
        return client

    # `verify` is unused: the session above holds the TLS (the connector's `ssl`)
    return AiohttpTransport(client=session, verify=httpx_default_tls())


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
    own text, not the unfinished message). One after a byte of the answer and before the
    end of the final head (a message begun, or a 1xx heard) is raised as `ClosedInHead`,
    on any connection.

    A connection whose answer invites a broken server's body (a 1xx's, a 204, a 304, a
    HEAD's) is never pooled: `feed_data` marks it to close (the module docstring of
    proxy/server/upstream.py says why).

    A connection closed before its answer was whole, while the backend still has bytes of
    the request to take, is reset (`close`): aiohttp writes the whole body at once, and
    its close would send all of it, and the FIN after it, to a backend that may read
    slowly or never. A request cancelled as its body goes out (its client left, the
    first byte timed out) ends so; one answered whole before the backend read its body
    closes as ever.

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
        self._to_close = False  # the response's body is framed by the connection's close

    def set_response_params(self, **kwargs: Any) -> None:
        self._state, self._finals, self._heard = _BUSY, 0, False
        super().set_response_params(**kwargs)

    def feed_data(self, data: Any, size: int = 0) -> None:
        if self._state is not _BUSY:  # a response no request is waiting for
            self.fault(self._unasked())
            return
        self._heard = True
        code = data[0].code
        if code < 200 or code == 204 or code == 304 or self._skip_payload:
            # Never reused: whatever follows a 101 is another protocol; the others (a 1xx
            # and what follows it, a 204, a 304, a HEAD's answer) invite a broken server
            # to send a body, which sent late would be the next request's answer.
            self._should_close = True
        if code >= 200 or code == 101:
            self._finals += 1
            if self._finals > 1:  # a second response to one request: never read
                self.fault("extra_bytes")
                return
            message = data[0]
            self._to_close = not message.chunked and "Content-Length" not in message.headers
        super().feed_data(data, size)

    def connection_lost(self, exc: BaseException | None) -> None:
        payload = self._payload
        if exc is not None and self._to_close and payload is not None and not payload.is_eof():
            # aiohttp ends a body read to the close at any close; only a clean one ends it
            # (RFC 9112 §6.3, item 8), a reset cuts it short (§8), as the wire reads it.
            cut = aiohttp.ClientPayloadError(f"response body cut short: {exc!r}")
            cut.__cause__ = exc  # the reset in the system's words, as the wire tells it
            payload.set_exception(cut)
        super().connection_lost(exc)
        if payload is not None:
            _name_the_cut(payload.exception(), exc)

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

    def close(self) -> None:
        transport = self.transport
        if transport is not None and not self._answered_whole():
            close_or_reset(transport)  # aiohttp's close of it then changes nothing
        super().close()

    def _answered_whole(self) -> bool:
        """Whether the current request's answer came whole (its final head, and its body
        to the end): a connection closed then closes as ever."""
        payload = self._payload
        return self._finals > 0 and (payload is None or payload.is_eof())

    def fault(self, kind: str) -> None:
        """Close the connection for breaking HTTP/1.1, and count it once."""
        self._should_close = True
        if not self._faulted:
            self._faulted = True
            self._count(kind)
        if self.transport is not None:
            close_or_reset(self.transport)

    def set_exception(self, exc: BaseException, exc_cause: BaseException = _EXC_SENTINEL) -> None:
        if (
            type(exc) is aiohttp.ServerDisconnectedError  # a clean close, not a reset
            and isinstance(exc.message, str)  # no response begun
            and self._state is _BUSY
            and self._reused
            and not self._heard
            and not self._held_head_bytes()
        ):
            exc = _AiohttpClosedUnanswered()
        elif (
            type(exc) is aiohttp.ServerDisconnectedError
            and self._state is _BUSY
            and self._finals == 0  # else the head is in: the body's reader is told
            and (not isinstance(exc.message, str) or self._heard or self._held_head_bytes())
        ):
            exc = _AiohttpClosedInHead()
        if isinstance(exc, HttpProcessingError) and not self._faulted:
            # The parser refused what came (aiohttp closed the transport already).
            self._faulted = True
            self._count("malformed" if self._state is _BUSY else self._unasked())
            if self._finals == 0:  # in the head: its message holds the upstream's header
                # bytes (a cookie, a token) and would reach the client and the record
                told = _malformed(exc)
                told.__cause__ = exc
                exc = told
        payload = self._payload
        super().set_exception(exc, exc_cause)
        if payload is not None and payload.exception() is None and not payload.is_eof():
            broken = aiohttp.ClientPayloadError(f"malformed response body: {exc!r}")
            if isinstance(exc, HttpProcessingError):
                broken.__cause__ = _malformed(exc)
            payload.set_exception(broken)

    def _held_head_bytes(self) -> bool:
        """Whether the parser held bytes of a head it never finished, as the connection
        closed (asked only then, before aiohttp drops the parser). aiohttp's pure-Python
        parser (AIOHTTP_NO_EXTENSIONS) keeps them in `_lines` (its `feed_eof` adds the
        line cut short) and gives up on a status line cut short, where the C parser,
        which has no `_lines`, hands on the message begun."""
        return bool(getattr(self._parser, "_lines", None))


def _malformed(exc: HttpProcessingError) -> UpstreamProtocolError:
    """A head or body the parser refused, in the wire's words ("malformed response: Invalid
    character in chunk size", proxy/server/wire/upstream.py): llhttp's reason, aiohttp's
    message without the bytes it quotes (`parser_words`: its C parser adds them and a
    caret, _http_parser.pyx parser_error_from_errno; its pure-Python parser puts them
    after the reason, "Invalid HTTP header: b'...'"); never str(exc), which opens with
    aiohttp's internal code, "400, message:", no status any peer sent."""
    reason = parser_words(" ".join(str(exc.message).split())) or type(exc).__name__
    return UpstreamProtocolError("malformed", f"malformed response: {reason}")


def _name_the_cut(error: BaseException | None, lost: BaseException | None) -> None:
    """A body cut short by the connection's end, told as the wire tells it: a clean close
    as UpstreamClosed in UPSTREAM_FAULTS' words, a reset as the system's reset error.
    aiohttp gives its payload error the parser's ContentLengthError or
    TransferEncodingError as the cause ("400, message: Not enough data to satisfy
    transfer length header.", the reset only in the outer error's text), for either end;
    the cause is replaced here, on the very exception a waiting reader is about to get,
    since no reader has run yet (aiohttp's `connection_lost` wakes them with call_soon)."""
    if isinstance(error, aiohttp.ClientPayloadError) and isinstance(
        error.__cause__, (ContentLengthError, TransferEncodingError)
    ):
        closed = UpstreamClosed(
            fault_words("closed_early", where="before the end of the response body")
        )
        error.__cause__ = lost if lost is not None else closed


class _TellsPooled(aiohttp.BaseConnector):
    """aiohttp's connector, telling a connection when it goes into the pool."""

    def _release(self, key: Any, protocol: ResponseHandler, *, should_close: bool = False) -> None:
        super()._release(key, protocol, should_close=should_close)
        pooled = protocol.transport is not None and not self._closed  # else closed
        if pooled and isinstance(protocol, _GuardedHandler):
            protocol.pooled()


class _GuardedConnector(_TellsPooled, aiohttp.TCPConnector):
    pass


class _GuardedUnixConnector(_TellsPooled, aiohttp.UnixConnector):
    async def _create_connection(
        self, req: ClientRequest, traces: list[Any], timeout: aiohttp.ClientTimeout
    ) -> ResponseHandler:
        # aiohttp's own (3.14 connector.py UnixConnector._create_connection), waiting
        # while the listener's backlog is full as every path does (dial.connect_unix):
        # asyncio's connect fails at once there, a 502 where the others time out, a 504.
        try:
            async with ceil_timeout(timeout.sock_connect, ceil_threshold=timeout.ceil_threshold):
                _, proto = await connect_unix(self._loop, self._factory, self._path)
        except OSError as exc:
            if exc.errno is None and isinstance(exc, asyncio.TimeoutError):
                raise
            raise UnixClientConnectorError(self.path, req.connection_key, exc) from exc
        return proto


async def send_text_headers(
    transport: httpx.AsyncBaseTransport,
    method: str,
    url: str,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    timeout: dict[str, float | None],
) -> httpx.Response | None:
    """`send_aiohttp`'s request when every header value is UTF-8 text, which is how aiohttp
    writes them; None otherwise, for httpx's transport to send byte for byte."""
    text_headers = utf8_headers(headers)
    if text_headers is None:
        return None
    return await send_aiohttp(transport, method, url, text_headers, body, timeout)


def utf8_headers(headers: list[tuple[bytes, bytes]]) -> CIMultiDict[str] | None:
    out: CIMultiDict[str] = CIMultiDict()
    try:
        for name, value in headers:
            out.add(name.decode("latin-1"), value.decode("utf-8"))
    except UnicodeDecodeError:
        return None
    return out


async def send_aiohttp(
    transport: httpx.AsyncBaseTransport,
    method: str,
    url: str,
    headers: CIMultiDict[str],
    body: bytes,
    timeout: dict[str, float | None],
) -> httpx.Response:
    """httpx-aiohttp's request, minus what changes the wire: it hands aiohttp the URL as
    text (yarl then normalises and re-quotes it) and headers httpx decoded with one
    guessed encoding for all of them."""
    assert isinstance(transport, AiohttpTransport), "not upstream_aiohttp's transport"
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
