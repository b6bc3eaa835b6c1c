"""The upstream HTTP client. What its exceptions mean is decided in proxy/core/errors.py.

httpx is the client; its transport is either httpx's own or aiohttp's (httpx-aiohttp,
proxy/server/upstream_aiohttp.py, imported only by a process that sends through it),
chosen by `--upstream-transport` after benchmarking (see docs/performance.md).

Neither library's pool keeps a misbehaving backend's bytes from reaching the wrong request
(issue 32): aiohttp queues every response it parses on the connection, so a second
response in one read, or one that arrives while the connection sits idle, is what the
next request on it reads; h11 keeps the bytes after a response's end in its buffer for the
next cycle. So both pools are guarded, per connection reuse and never per chunk:

- aiohttp (`_GuardedHandler`, `_GuardedConnector`): a second final response for one
  request, or any response parsed while the connection is pooled, closes it at once; a
  connection whose parser holds the start of a message when it goes idle, or when it is
  about to be reused (`is_connected`, which the connector asks before reusing one), is
  closed instead of reused.
- httpx/httpcore (`_GuardedPool`): an idle connection with bytes in h11's buffer
  (`trailing_data`) or readable bytes on its socket is closed before the pool can assign
  it (httpcore itself closes a readable idle socket; this counts it, on a plain TCP
  connection: a TLS one's bytes cannot tell data from the backend's clean close).

Each such close is counted by the `count` callback (Sinks.count_upstream_protocol_error):
tokenprobe_upstream_protocol_errors_total{kind}.

Bytes that come later, once the next request went out on the connection, no guard can tell
from that request's answer. The answers that by their nature invite a broken server to
send a body (a HEAD's, a 204, a 304, one after a 1xx) are rare in LLM traffic, so neither
pool keeps their connection, as the wire keeps none (proxy/server/wire/upstream.py): the
aiohttp protocol marks it to close as it hands on the message (`_GuardedHandler`), and
httpcore's connection closes as the response does (`_GuardedHTTP11Connection`), both
once per response. That close is no protocol error: not counted.

A request goes once more, on a new connection, exactly when the wire's does
(WireRequest.upstream_lost): the backend closed a reused keep-alive connection as the
request went out on it, cleanly and before any byte of answer, so it closed an idle
connection and never took the request (llama.cpp's server closes after every stream though
its head says Keep-Alive: docs/llamacpp.md), within `RESEND_WITHIN` of the send. The
guarded connections tell it, by raising
`ClosedUnanswered`, at no cost per request beyond a flag: aiohttp's protocol knows it was
pooled before (`_GuardedHandler`), httpcore's connection that it was open before the
request (`_GuardedConnection`). A fresh connection closed unanswered is never tried again:
the backend may have taken the request, and a POST must not run twice.
"""

from __future__ import annotations

import re
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable
from time import perf_counter
from typing import Any

import anyio
import anyio.abc
import h11
import httpcore
import httpcore._backends.base as httpcore_base
import httpx
from h11._readers import ChunkedReader
from h11._receivebuffer import ReceiveBuffer
from httpcore._backends.anyio import AnyIOStream  # what httpcore's AnyIOBackend returns

from proxy.core.errors import (
    ConnectFailed,
    ConnectTimedOut,
    classify_exception,
    connect_timed_out,
    fault_words,
    type_names,
)
from proxy.core.measurement import ErrorType
from proxy.server.backlog import drop_at_close, unacknowledged
from proxy.server.dial import (
    FULL_BACKLOG_PAUSES,
    httpx_default_tls,
    name_the_socket,
    upstream_tls,
    where,
)
from proxy.server.upstream_errors import (
    ClosedInHead,
    ClosedUnanswered,
    UpstreamClosed,
    UpstreamProtocolError,
)
from proxy.settings import Settings

KEEPALIVE_SECONDS = 4.0
_UNREACHABLE = ErrorType.UPSTREAM_UNREACHABLE
#: A request that went out on a reused connection goes once more, on a new one, only when
#: the backend closed that connection unanswered within this many seconds of the send: a
#: backend closing an idle connection as the request went out does so within a round
#: trip. One that held the request longer may have run it (a POST is not idempotent, RFC
#: 9110 §9.2.2: a proxy must not retry it on its own), and a second run is a second
#: generation: that request breaks (502) instead, on both data paths.
RESEND_WITHIN = 1.0

#: proxy.server.upstream_aiohttp.send_text_headers: (transport, method, url, headers, body,
#: timeout) -> the response, or None when a header value is not UTF-8 text.
AiohttpSend = Callable[
    [httpx.AsyncBaseTransport, str, str, list[tuple[bytes, bytes]], bytes, dict[str, float | None]],
    Awaitable[httpx.Response | None],
]


class _HttpxClosedUnanswered(ClosedUnanswered, httpx.RemoteProtocolError):
    pass


class _HttpxClosedInHead(ClosedInHead, httpx.RemoteProtocolError):
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
    send_aiohttp: AiohttpSend | None = None
    tls = upstream_tls(settings)  # the same trust and client certificate as the wire's
    if transport is None and settings.upstream_transport == "aiohttp":
        from proxy.server.upstream_aiohttp import aiohttp_transport, send_text_headers

        transport = aiohttp_transport(count, KEEPALIVE_SECONDS, settings.upstream_uds, tls)
        send_aiohttp = send_text_headers
    elif transport is None:
        transport = guarded_httpx_transport(limits, count, settings.upstream_uds, tls)
    client = UpstreamClient(transport=transport, timeout=timeout, limits=limits)
    client.send_aiohttp = send_aiohttp
    client.limits = limits
    client.count = count
    client.uds, client.tls = settings.upstream_uds, tls
    client.headers.clear()  # forward the client's headers, not httpx's defaults
    return client


# -- httpx (httpcore) ---------------------------------------------------------------------


def guarded_httpx_transport(
    limits: httpx.Limits,
    count: Callable[[str], None] = _uncounted,
    uds: str | None = None,
    tls: ssl.SSLContext | None = None,
) -> httpx.AsyncHTTPTransport:
    """httpx's own transport, on a pool that closes dirty idle connections; through the
    Unix socket `uds` when given (--upstream-uds), with the TLS context `tls` when given
    (else httpx's own)."""
    trust = tls or httpx_default_tls()  # an http:// upstream's: never used
    transport = _GuardedHTTPTransport(count, limits=limits, uds=uds, verify=trust)
    old = transport._pool
    transport._pool = _GuardedPool(
        count,
        ssl_context=old._ssl_context,
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry,
        uds=uds,
        network_backend=None if uds is None else _UnixBackend(),
    )
    return transport


class _UnixBackend(httpcore.AnyIOBackend):
    """httpcore's anyio backend, connecting to the Unix socket of --upstream-uds as every
    path does (proxy.server.dial.connect_unix): waiting while the listener's backlog is
    full, a pause at a time. anyio's own connect_unix waits for the socket to be writable
    after each EAGAIN, which an unconnected Unix socket always is: it tried again at
    once, over and over, a whole core busy until --connect-timeout ran out."""

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[httpcore_base.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.setblocking(False)
        try:  # the errors as httpcore's AnyIOBackend maps them
            with anyio.fail_after(timeout):
                pause, most = FULL_BACKLOG_PAUSES
                while True:
                    try:
                        raw.connect(path)  # a Unix connect is done or refused at once
                        break
                    except BlockingIOError:
                        await anyio.sleep(pause)
                        pause = min(pause * 2, most)
            for option in socket_options or ():
                raw.setsockopt(*option)
            stream = await anyio.abc.UNIXSocketStream.from_socket(raw)
        except TimeoutError as exc:
            raw.close()
            raise httpcore.ConnectTimeout(str(exc)) from exc
        except OSError as exc:
            raw.close()
            raise httpcore.ConnectError(str(exc)) from exc
        except BaseException:
            raw.close()
            raise
        return AnyIOStream(stream)


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
            if "disconnected" in text:  # the backend closing is no protocol error
                raise
            kind = "upgrade" if "SWITCH" in text else "malformed"
            self._count(kind)
            said = _H11_FAULTS.get(text)
            if said is None and (number := _H11_NOT_A_STATUS.fullmatch(text)) is not None:
                said = fault_words("not_a_status", status=int(number[1]))
            if said is None:
                raise
            raise UpstreamProtocolError(kind, said) from exc  # as the other paths say it
        headers = response.headers
        if "transfer-encoding" in headers and "content-length" in headers:
            self._count("malformed")
            await response.aclose()  # unread: httpcore closes the connection
            raise UpstreamProtocolError(
                "malformed", "the upstream sent Content-Length and Transfer-Encoding together"
            )
        return response


#: h11's words for the faults the other paths refuse in theirs (UPSTREAM_FAULTS):
#: h11/_state.py ("Received server _SWITCH_UPGRADE event without a pending proposal")
#: and h11/_headers.py, which keeps no coding it names ("Only Transfer-Encoding: chunked is
#: supported"), so the codings go untold here.
_H11_FAULTS = {
    "Received server _SWITCH_UPGRADE event without a pending proposal": fault_words(
        "unasked_switch"
    ),
    "Only Transfer-Encoding: chunked is supported": fault_words("transfer_coding", said=""),
}


#: h11's words for a status line whose three digits are below 100 (h11/_events.py
#: InformationalResponse; its reader takes any three digits, h11/_abnf.py status_code).
_H11_NOT_A_STATUS = re.compile(
    r"InformationalResponse status_code should be in range \[100, 200\), not (\d+)"
)

#: httpcore's words for a response that never began: the connection closed cleanly
#: before any byte of it (httpcore/_async/http11.py `_receive_event`).
_H11_UNANSWERED = "Server disconnected without sending a response."

#: httpcore's words for a body a clean close cut short (h11's `ConnectionClosed` before
#: the body's end, httpcore/_async/http11.py).
_H11_CUT = "peer closed connection without sending complete message body"


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
            self._count,
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
    byte of the answer: h11 still waits for the response head, holds no byte of one, and
    parsed no response for this request, not even a 1xx. A 1xx is an answer, as on the
    wire and the aiohttp transport: the backend took the request (RFC 9110 §15.2, an
    interim response on the way to completing it), so it is not sent again. h11 keeps
    no other trace of a 1xx than `their_http_version`, which it sets for every response
    it parses and, in a client, reads for nothing: it is cleared as a reused connection
    takes a request, and still None at the close when none came.

    httpcore says "Server disconnected without sending a response." for any clean close
    before the end of the final head; one after a byte of it (in h11's buffer) or a 1xx,
    on any connection, is raised as `ClosedInHead`, as the wire tells it.

    Its HTTP/1.1 connection is a `_GuardedHTTP11Connection`, made here as httpcore makes
    its own (`_open`): the pool asks for no HTTP/2, and offers none in TLS (ALPN)."""

    def __init__(self, count: Callable[[str], None], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._count = count

    async def handle_async_request(self, request: httpcore.Request) -> httpcore.Response:
        inner = self._connection
        reused = inner is not None
        if inner is None:
            await self._open(request)
        if isinstance(inner, httpcore.AsyncHTTP11Connection):
            inner._h11_state.their_http_version = None
        try:
            return await super().handle_async_request(request)
        except httpcore.RemoteProtocolError as exc:
            inner = self._connection
            if (
                reused
                and isinstance(inner, httpcore.AsyncHTTP11Connection)
                and inner._h11_state.their_state is h11.SEND_RESPONSE
                and inner._h11_state.their_http_version is None  # not even a 1xx came
                and not inner._h11_state.trailing_data[0]
            ):
                # httpx passes this on as it is: it is no httpcore error to translate.
                raise _HttpxClosedUnanswered(str(exc)) from exc
            if (
                str(exc) == _H11_UNANSWERED
                and isinstance(inner, httpcore.AsyncHTTP11Connection)
                and (
                    inner._h11_state.their_http_version is not None  # a 1xx came
                    or inner._h11_state.trailing_data[0]  # the head begun
                )
            ):
                raise _HttpxClosedInHead(str(exc)) from exc
            raise

    async def _open(self, request: httpcore.Request) -> None:
        """httpcore's own opening of the connection (AsyncHTTPConnection's
        handle_async_request, HTTP/1.1), with the guarded HTTP/1.1 connection on it."""
        try:
            async with self._request_lock:
                if self._connection is None:
                    stream = await self._connect(request)
                    self._connection = _GuardedHTTP11Connection(
                        self._count,
                        origin=self._origin,
                        stream=stream,
                        keepalive_expiry=self._keepalive_expiry,
                    )
        except BaseException:
            self._connect_failed = True
            raise


#: h11's states of the backend's side once its answer came whole (MUST_CLOSE: it said
#: Connection: close).
_ANSWERED_WHOLE = (h11.DONE, h11.MUST_CLOSE)


class _GuardedHTTP11Connection(httpcore.AsyncHTTP11Connection):
    """httpcore's HTTP/1.1 connection, which:

    - is not kept after an answer that invites a broken server to send a body (a HEAD's,
      a 204, a 304, one after a 1xx), as on the other paths: sent late, such a body
      would be the next request's answer. Decided once per response, at its head; the
      connection closes when the response does (`_response_closed`);
    - reads a chunked body with `_CheckedChunkedReader` (installed once per response,
      at its head, in the place of h11's own, which has read nothing yet);
    - is reset as it closes before its answer was whole, while the backend still has
      bytes of the request to take (`aclose`): a request cancelled as its body goes out
      (its client left, the first byte timed out). anyio's close drops the transport's
      buffer, but the kernel still sent its queue (about 4 MB on loopback), and the FIN
      after it, to a backend that may read slowly or never (proxy/server/backlog.py)."""

    def __init__(self, count: Callable[[str], None], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._count = count
        self._invites_a_body = False

    async def handle_async_request(self, request: httpcore.Request) -> httpcore.Response:
        response = await super().handle_async_request(request)
        if request.method == b"HEAD" or response.status == 204 or response.status == 304:
            self._invites_a_body = True
        h11_state = self._h11_state
        if type(h11_state._reader) is ChunkedReader:
            h11_state._reader = _CheckedChunkedReader(self._count)
        return response

    async def _receive_response_headers(
        self, request: httpcore.Request
    ) -> tuple[bytes, int, bytes, list[tuple[bytes, bytes]], bytes]:
        """httpcore's own (1.0), noting a 1xx before the final head: httpcore drops it,
        and h11 keeps no trace of one (`_GuardedConnection`)."""
        timeout = request.extensions.get("timeout", {}).get("read", None)
        while True:
            event = await self._receive_event(timeout=timeout)
            if isinstance(event, h11.Response):
                break
            if isinstance(event, h11.InformationalResponse):
                if event.status_code == 101:
                    break
                self._invites_a_body = True
        trailing_data, _ = self._h11_state.trailing_data
        return (
            b"HTTP/" + event.http_version,
            event.status_code,
            event.reason,
            event.headers.raw_items(),
            trailing_data,
        )

    async def aclose(self) -> None:
        state = self._h11_state
        if state.their_state not in _ANSWERED_WHOLE:
            sock = self._network_stream.get_extra_info("socket")
            if state.our_state is h11.SEND_BODY or unacknowledged(sock):
                drop_at_close(sock)
        await super().aclose()

    async def _response_closed(self) -> None:
        # the response's end, or its break: the flag is this response's, and spent here
        invites_a_body, self._invites_a_body = self._invites_a_body, False
        await super()._response_closed()
        if invites_a_body and self.is_idle():  # never pooled
            if self._h11_state.trailing_data[0]:  # read with the answer, after its end,
                self._count("extra_bytes")  # as the pool's check counts them (_idle_dirt)
            await self.aclose()


class _CheckedChunkedReader(ChunkedReader):
    """h11's reader of a chunked body, failing at once where h11 would wait: a chunk size
    line ended by a bare LF (`2\\nok\\n0\\n\\n`; RFC 9112 §7.1 ends it with CRLF, and llhttp
    and aiohttp refuse it at once). h11 holds such bytes while it waits for a CRLF, which
    a backend that keeps the connection open never sends: the client held a 200 head
    until --idle-timeout. Each framing fault, h11's own too (a size that is not hex), is
    counted `malformed`, as the wire counts it. The check runs only when h11 found
    nothing to hand on (once per read), on the few bytes of a size line.

    It hands on all the data one socket read brought as one piece, however many chunks
    framed it: h11 hands on a piece per chunk, and the relay times each piece as it gets
    it (forward.py), a few microseconds apart, so tokens that all came in one read had
    a TPOT and a decode speed of thousands of tokens a second. The wire stamps each read
    once (proxy/server/wire/upstream.py), and aiohttp's `readany` hands on all it has
    read together, so the three paths time a read alike (docs/measured.md). What
    follows the last of the data (the end of the body, a framing fault) is kept for the
    next call, so the data goes out first, as before."""

    def __init__(self, count: Callable[[str], None]) -> None:
        super().__init__()
        self._count = count
        self._after: h11.EndOfMessage | h11.ProtocolError | None = None

    def __call__(self, buf: ReceiveBuffer) -> h11.Data | h11.EndOfMessage | None:
        after = self._after
        if after is not None:
            self._after = None
            if isinstance(after, h11.ProtocolError):
                raise after
            return after
        event = self._step(buf)
        if type(event) is not h11.Data or not buf:
            return event
        pieces, last = [event.data], event
        while buf:  # the rest of the read: more chunks' data, or what ends it
            try:
                more = self._step(buf)
            except h11.ProtocolError as exc:
                self._after = exc
                break
            if not isinstance(more, h11.Data):  # None: the rest needs the next read
                self._after = more
                break
            pieces.append(more.data)
            last = more
        if last is event:
            return event
        return h11.Data(
            data=b"".join(pieces), chunk_start=event.chunk_start, chunk_end=last.chunk_end
        )

    def _step(self, buf: ReceiveBuffer) -> h11.Data | h11.EndOfMessage | None:
        try:
            event = super().__call__(buf)
            if (
                event is None
                and not self._bytes_in_chunk  # waiting for a size line: no CRLF in buf
                and not self._bytes_to_discard
                and not self._reading_trailer
                and b"\n" in buf._data
            ):
                raise h11.RemoteProtocolError("illegal chunk header: a line ended by a bare LF")
        except h11.ProtocolError:
            self._count("malformed")
            raise
        return event


def _idle_dirt(conn: httpcore.AsyncHTTP11Connection) -> str | None:
    if conn._h11_state.trailing_data[0]:  # read with the last response, after its end
        return "extra_bytes"
    stream = conn._network_stream
    if not stream.get_extra_info("is_readable"):
        return None
    if stream.get_extra_info("ssl_object") is not None:
        # TLS: the socket's bytes may be the backend's close_notify, a clean close that TLS
        # 1.3 encrypts as it does data, and httpcore reads them only when asked. Readable,
        # the connection is closed all the same (httpcore's expiry), and counted as nothing.
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
        # Where upstream_transport is proxy.server.upstream_aiohttp's: its way to send.
        self.send_aiohttp: AiohttpSend | None = None
        self.limits = httpx.Limits()
        self.count: Callable[[str], None] = _uncounted
        self.uds: str | None = None  # --upstream-uds, for the transports made later
        self.tls: ssl.SSLContext | None = None  # and the upstream's TLS context
        self._bytes_transport: httpx.AsyncHTTPTransport | None = None
        self._fresh_transport: httpx.AsyncHTTPTransport | None = None

    def bytes_transport(self) -> httpx.AsyncBaseTransport:
        """httpx's own transport, for requests aiohttp cannot send byte for byte."""
        if isinstance(self.upstream_transport, httpx.AsyncHTTPTransport):
            return self.upstream_transport
        if self._bytes_transport is None:
            self._bytes_transport = guarded_httpx_transport(
                self.limits, self.count, self.uds, self.tls
            )
        return self._bytes_transport

    def fresh_transport(self) -> httpx.AsyncBaseTransport:
        """httpx's own transport, on a new connection for each request, kept by none
        (httpcore closes an idle connection beyond max_keepalive_connections): where a
        request goes once more after a kept-alive connection closed unanswered."""
        if self._fresh_transport is None:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
            self._fresh_transport = guarded_httpx_transport(limits, self.count, self.uds, self.tls)
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

    An upstream fault that the transports tell in their own words is raised in the words
    every path uses (proxy.core.errors.UPSTREAM_FAULTS), with the address tried, as the
    wire's `dial` raises it: a connect timeout (`ConnectTimedOut`), an unreachable
    upstream (`ConnectFailed`), and a status line whose three digits are no final HTTP
    status (an unasked 101, a 600: `UpstreamProtocolError`, counted).
    """
    if not isinstance(client, UpstreamClient):
        request = httpx.Request(method, url, headers=headers, content=body)
        return await client.send(request, stream=True)
    try:
        response = await _send_once_more_if_unanswered(client, method, url, headers, body)
    except Exception as exc:
        if client.uds is not None:
            name_the_socket(exc, client.uds)
        # in the words every path uses (dial's), and naming where, as dial does
        if connect_timed_out(exc):
            limit = client.timeout.connect or 0.0
            raise ConnectTimedOut(limit, _where(url, client.uds)) from exc
        if client.uds is None and classify_exception(exc, after_headers=False) is _UNREACHABLE:
            raise ConnectFailed(str(exc), _where(url, None)) from exc
        if _closed_in_head(exc):  # as the wire's _closed_early says it
            where = "before the end of the response head"
            raise UpstreamClosed(fault_words("closed_early", where=where)) from exc
        if _closed_unanswered(exc):
            raise UpstreamClosed(fault_words("closed_early", where="before answering")) from exc
        raise
    status = response.status_code
    if not 200 <= status <= 599:
        # aiohttp, as llhttp and h11, reads any three digits as a status, and hands on a 101
        # it was never asked for (httpx's h11 refuses that itself: _GuardedHTTPTransport)
        kind, said = (
            ("upgrade", fault_words("unasked_switch"))
            if status == 101
            else ("malformed", fault_words("not_a_status", status=status))
        )
        client.count(kind)
        await response.aclose()
        raise UpstreamProtocolError(kind, said)
    return response


async def _send_once_more_if_unanswered(
    client: UpstreamClient,
    method: str,
    url: str,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
) -> httpx.Response:
    """The send, and the one resend of a request that a kept-alive connection closed
    unanswered (send_upstream's docstring)."""
    # The relay times the gaps between chunks itself (proxy.server.exchange.IdleTimer): a transport's
    # read timeout would cost a timer per chunk, and would also cut the wait for the
    # response headers, which first_byte_timeout governs.
    timeout = {**client.timeout.as_dict(), "read": None}
    sent_at = perf_counter()
    transport = client.upstream_transport
    try:
        if client.send_aiohttp is not None:
            sent = await client.send_aiohttp(transport, method, url, headers, body, timeout)
            if sent is not None:
                return sent
            # aiohttp writes header values as UTF-8 text: other bytes go through httpcore,
            # which writes them as they are.
            transport = client.bytes_transport()
        return await _send_httpx(transport, method, url, headers, body, timeout)
    except ClosedUnanswered:
        if perf_counter() - sent_at >= RESEND_WITHIN:
            raise
        return await _send_httpx(client.fresh_transport(), method, url, headers, body, timeout)


def _closed_in_head(exc: Exception) -> bool:
    """Whether the upstream closed the connection cleanly inside its answer's head: a
    `ClosedInHead` from either transport, or aiohttp's ServerDisconnectedError whose
    `message` is the message begun (a RawResponseMessage: never told to a client)."""
    if isinstance(exc, ClosedInHead):
        return True
    said = getattr(exc, "message", None)
    return "aiohttp.ServerDisconnectedError" in type_names(type(exc)) and not isinstance(said, str)


def _closed_unanswered(exc: Exception) -> bool:
    """Whether the upstream closed the connection cleanly before any byte of an answer,
    in either transport's words: httpcore's `_H11_UNANSWERED`, aiohttp's
    ServerDisconnectedError whose `message` is its text (no response begun: else the
    message begun), or a `ClosedUnanswered` not sent again (its class is private)."""
    if isinstance(exc, ClosedUnanswered):
        return True
    if isinstance(exc, httpx.RemoteProtocolError):
        return str(exc) == _H11_UNANSWERED
    said = getattr(exc, "message", None)
    return "aiohttp.ServerDisconnectedError" in type_names(type(exc)) and isinstance(said, str)


def _where(url: str, uds: str | None) -> str:
    """The address a request to `url` was sent to, as `dial` names the wire's."""
    parsed = httpx.URL(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    return where(parsed.host, port, uds)


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
    if request.url.host.endswith("."):  # TLS's name without it, as the wire's (dial.py)
        request.extensions["sni_hostname"] = request.url.host.rstrip(".")
    response = await transport.handle_async_request(request)
    response.request = request
    return response


def _request_target(url: str) -> bytes:
    after_scheme = url.partition("//")[2]
    slash = after_scheme.find("/")
    return after_scheme[slash:].encode("ascii") if slash >= 0 else b"/"


def body_reader(response: httpx.Response) -> Callable[[], Awaitable[bytes]]:
    """A coroutine function giving the next raw chunk of the body on each call, b"" at its end.

    With the aiohttp transport it reads aiohttp's stream itself: httpx would pass each
    chunk through three more async iterators for the same bytes. aiohttp's errors then
    arrive unwrapped, and `proxy.core.errors.classify_exception` knows them.
    """
    inner = getattr(response.stream, "_aiohttp_response", None)  # httpx-aiohttp's stream
    if inner is not None:
        return inner.content.readany  # type: ignore[no-any-return]
    chunks = response.aiter_raw()

    async def read() -> bytes:
        try:
            return await anext(chunks, b"")
        except httpx.RemoteProtocolError as exc:
            if str(exc).startswith(_H11_CUT):  # told as the other paths tell it
                where = "before the end of the response body"
                raise UpstreamClosed(fault_words("closed_early", where=where)) from exc
            raise

    return read
