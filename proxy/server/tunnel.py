"""WebSockets through the proxy: a byte tunnel between the client and the upstream.

The wire's connection protocol parses a request head; when it is a well-formed WebSocket
handshake (`is_websocket_upgrade`, the one check: GET on HTTP/1.1, `Upgrade: websocket`,
`Connection: upgrade`, a key, version 13, no body) for a path that is not the proxy's own,
it stops parsing that connection and, once every response before it on the connection has
ended, calls `take_over` with the head and whatever the client sent after it. Any other
Upgrade (a POST with `Upgrade: websocket` included) is an ordinary request to the HTTP
relay. From then on this module owns both connections:

1. It connects to the upstream (--connect-timeout) and sends the handshake: the request
   target normalised (proxy/core/paths; one that cannot be gets the HTTP relay's 400
   `invalid_request_target`) with the upstream's base path in front (UpstreamURL,
   proxy/core/upstream_url.py),
   the Host line the upstream's authority, and the client's headers through the HTTP
   relay's header policy (`handshake_headers`: hop-by-hop headers, those Connection names
   and Proxy-Authorization stop here; Sec-WebSocket-Key, -Version, -Protocol,
   -Extensions, Origin... pass as sent). An unreachable upstream gets the client the
   proxy's 502/504 error body (proxy.core.errors.relay_failure), as an HTTP request would.
2. Nothing the client sent after its head goes upstream before the upstream's 101: the
   client's connection is not read until then, and what was read already is held. The
   upstream might refuse the upgrade and read those bytes as a request the proxy never
   parsed. Everything the upstream sends is written to the client as it arrives, the
   response head included; an httptools parser reads the same bytes on the side. A 101
   opens the tunnel, and the held bytes go. Any other final status (a refusal) reaches the
   client exactly as sent, body included, and both connections close when its body ends;
   the held bytes never go.
3. In the tunnel, each read goes to the other side first, unchanged; then the direction's
   `FrameBounds` notes where frames end and which side sent a close frame first, and,
   when the path has a WebSocket API (proxy/core/wsseam.py), the direction's `FrameReader`
   hands its messages to that API's session. Observer failures stop here (`_watch`): the
   session is no longer watched, a counter says so, the bytes go on.
4. Backpressure both ways: when one side's write buffer passes its high-water mark,
   reading from the other side pauses until it drains (asyncio's pause/resume_writing).
5. The end: either side's connection ending closes the other at once (buffered bytes are
   flushed first; a peer that will not take them is aborted after `close_grace`). A
   tunnel with no byte either way for --ws-idle-timeout is closed. `TunnelHandle.shutdown`
   (the drain on SIGTERM) writes a close frame (1001, going away) to both sides at a frame
   boundary and closes once both answered, or after `close_grace`.

Each tunnel is counted once when it ends (`WsMetrics`: sessions by route and outcome,
in flight, duration from the upgrade request's arrival to the close).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from time import perf_counter, time
from typing import cast

import httptools
from prometheus_client import CollectorRegistry

from proxy.core.errors import Cause, error_body, error_shape, relay_failure
from proxy.core.upstream_url import UpstreamURL
from proxy.core.wsframes import (
    DeflateParams,
    FrameBounds,
    FrameError,
    FrameReader,
    close_frame,
    deflate_params,
)
from proxy.core.wsseam import CLOSE_CAUSES, WsApi, WsSession, ws_api_for
from proxy.server.admission import Refused, target
from proxy.server.headers import handshake_headers
from proxy.settings import Settings
from proxy.sinks.dispatch import Sinks
from proxy.sinks.metrics import WsMetrics

log = logging.getLogger("tokenprobe")

GOING_AWAY = 1001
SHUTDOWN_REASON = "proxy shutting down"


@dataclass(eq=False)
class TunnelContext:
    """What every tunnel of one server shares; built once by `tunnel_context`."""

    host: str  # the upstream's address and port
    port: int
    authority: bytes  # the Host line's value towards the upstream
    base_path: str  # the upstream URL's path ("" for none), put before each target
    ssl: ssl.SSLContext | None  # for an https:// upstream
    connect_timeout: float
    idle_timeout: float  # --ws-idle-timeout
    max_message_bytes: int  # largest message a FrameReader assembles (--max-event-bytes)
    metrics: WsMetrics
    sinks: Sinks
    apis: Callable[[str], WsApi | None] = ws_api_for
    close_grace: float = 2.0  # seconds a closing side gets to take its last bytes
    tunnels: set[Tunnel] = field(default_factory=set)  # open now, for `shutdown_all`

    def shutdown_all(self) -> None:
        """Drain every open tunnel (close frames both ways), as on SIGTERM."""
        for tunnel in list(self.tunnels):
            tunnel.shutdown()


def tunnel_context(settings: Settings, registry: CollectorRegistry, sinks: Sinks) -> TunnelContext:
    """The tunnels' shared parts for these settings; call once per registry."""
    upstream = UpstreamURL.parse(settings.upstream)  # the one parse every path uses
    return TunnelContext(
        host=upstream.host,
        port=upstream.port,
        authority=upstream.authority,
        base_path=upstream.base_path,
        ssl=ssl.create_default_context() if upstream.tls else None,
        connect_timeout=settings.connect_timeout,
        idle_timeout=settings.ws_idle_timeout,
        max_message_bytes=settings.max_event_bytes,
        metrics=WsMetrics(registry),
        sinks=sinks,
    )


def is_websocket_upgrade(
    method: bytes, headers: Sequence[tuple[bytes, bytes]], *, http_11: bool = True
) -> bool:
    """A well-formed WebSocket opening handshake (RFC 6455 §4.1): a GET on HTTP/1.1 with
    `Upgrade: websocket`, `Connection: upgrade`, one Sec-WebSocket-Key that is 16 bytes
    in base64, `Sec-WebSocket-Version: 13`, and no body. The one request either data path
    tunnels (the ASGI relay refuses it itself); anything else asking to upgrade (h2c, a
    POST with `Upgrade: websocket`, a handshake with a body) is an ordinary request, its
    Upgrade dropped as hop-by-hop."""
    if method != b"GET" or not http_11:
        return False
    upgrade = connection = False
    keys: list[bytes] = []
    version = b""
    for name, value in headers:
        lower = name.lower()
        if lower == b"upgrade":
            upgrade = upgrade or b"websocket" in _tokens(value)
        elif lower == b"connection":
            connection = connection or b"upgrade" in _tokens(value)
        elif lower == b"sec-websocket-key":
            keys.append(value.strip())
        elif lower == b"sec-websocket-version":
            version = value.strip()
        elif lower == b"transfer-encoding" or (
            lower == b"content-length" and value.strip() != b"0"
        ):
            return False
    return upgrade and connection and version == b"13" and len(keys) == 1 and _nonce(keys[0])


def _nonce(key: bytes) -> bool:
    try:
        return len(base64.b64decode(key, validate=True)) == 16
    except binascii.Error:
        return False


def _tokens(value: bytes) -> list[bytes]:
    return [token.strip().lower() for token in value.split(b",")]


class TunnelHandle:
    """The wire's hold on one tunnel: `shutdown()` drains it, `closed` resolves with the
    outcome once it has ended (the client's connection is then no longer the wire's)."""

    __slots__ = ("__weakref__", "_tunnel")

    def __init__(self, tunnel: Tunnel) -> None:
        self._tunnel = tunnel

    @property
    def closed(self) -> asyncio.Future[str]:
        return self._tunnel.closed

    def shutdown(self) -> None:
        self._tunnel.shutdown()


def take_over(
    transport: asyncio.Transport,
    head: bytes,
    rest: bytes,
    context: TunnelContext,
    *,
    start: float | None = None,
) -> TunnelHandle:
    """Tunnel this client connection to the upstream. `head` is the request head (request
    line to the blank line) of a request `is_websocket_upgrade` accepted, `rest` what the
    client sent after it; `start` the perf_counter() of the head's arrival (default: now)."""
    tunnel = Tunnel(transport, context, start if start is not None else perf_counter())
    tunnel.begin(head, rest)
    return TunnelHandle(tunnel)


class _Side(asyncio.Protocol):
    """One connection of a tunnel; everything it hears goes to the tunnel."""

    __slots__ = ("from_client", "tunnel")

    def __init__(self, tunnel: Tunnel, from_client: bool) -> None:
        self.tunnel = tunnel
        self.from_client = from_client

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Only the upstream's: the client's connection was open before the tunnel.
        self.tunnel.upstream = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def data_received(self, data: bytes) -> None:
        if self.from_client:
            self.tunnel.from_client(data)
        else:
            self.tunnel.from_upstream(data)

    def eof_received(self) -> bool | None:
        return None  # the transport closes; connection_lost ends the tunnel

    def connection_lost(self, exc: Exception | None) -> None:
        self.tunnel.lost(self.from_client)

    def pause_writing(self) -> None:
        self.tunnel.writes_full(self.from_client, True)

    def resume_writing(self) -> None:
        self.tunnel.writes_full(self.from_client, False)


class Tunnel:
    """One WebSocket session: two connections, their frame bounds, and the API's watcher."""

    def __init__(self, client: asyncio.Transport, context: TunnelContext, start: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.context = context
        self.start = start
        self.started_at = time() - (perf_counter() - start)
        self.client = client
        self.upstream: asyncio.Transport | None = None
        self.closed: asyncio.Future[str] = self.loop.create_future()
        self.outcome: str | None = None
        self.route = "other"
        self.path = "/"
        self.query = ""
        self.api: WsApi | None = None
        self.key: str | None = None
        self.open = False  # the upstream answered 101
        self.ended = False
        self._response: httptools.HttpResponseParser | None = httptools.HttpResponseParser(
            _ResponseHead(self)
        )
        self._status = 0
        self._extensions: str | None = None
        self._relayed = False  # some upstream byte reached the client
        self._held: list[bytes] = []  # client bytes read before the 101: sent after it
        self.client_bounds = FrameBounds()
        self.upstream_bounds = FrameBounds()
        self.first_close: bool | None = None  # True: the client sent the first close frame
        self._session: WsSession | None = None
        self._readers: tuple[FrameReader, FrameReader] | None = None  # (client, upstream)
        self._paused: set[bool] = set()  # sides whose reading is paused (True: the client)
        self._full: set[bool] = set()  # sides whose write buffer is over its high-water mark
        self._last = self.loop.time()
        self._idle: asyncio.TimerHandle | None = None
        self._abort: asyncio.TimerHandle | None = None
        self._draining = False
        self._drained: set[bool] = set()  # sides a shutdown close frame was written to
        self._connect: asyncio.Task[None] | None = None
        in_flight, self._duration, self._outcomes = context.metrics.for_route("other")
        self._in_flight = in_flight

    # -- the handshake ------------------------------------------------------------------

    def begin(self, head: bytes, rest: bytes) -> None:
        self.context.tunnels.add(self)
        self.client.set_protocol(_Side(self, True))
        self._pause(True)  # until the upstream's 101
        try:
            head = self._admit(head)
        except Refused as refusal:
            self._in_flight.inc()
            self._answer(refusal.status, refusal.kind, refusal.message)
            self.end("bad_request")
            return
        self._in_flight.inc()
        if rest:
            self._held.append(rest)
        self._connect = self.loop.create_task(self._open_upstream(head))

    def _admit(self, head: bytes) -> bytes:
        """The handshake to send upstream (raises `Refused`): the normalised target after
        the base path, the Host line the upstream's, the headers through the HTTP relay's
        policy; the route, the API and the key label read from it."""
        lines = head.split(b"\n")
        method, _, remainder = lines[0].partition(b" ")
        request_target, _, _ = remainder.strip().rpartition(b" ")
        raw_path, _, query = request_target.partition(b"?")
        parsed = target(raw_path, query)
        self.path, self.query = parsed.path, parsed.query
        headers: list[tuple[bytes, bytes]] = []
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if colon:
                headers.append((name.strip().lower(), value.strip()))
        out = [
            b"%s %s HTTP/1.1\r\nhost: %s\r\n"
            % (
                method,
                (self.context.base_path + parsed.request_target).encode(),
                self.context.authority,
            )
        ]
        out.extend(b"%s: %s\r\n" % pair for pair in handshake_headers(headers))
        out.append(b"\r\n")
        self.api = self.context.apis(self.path)
        if self.api is not None:
            self.route = self.api.endpoint
            self._in_flight, self._duration, self._outcomes = self.context.metrics.for_route(
                self.route
            )
        keys = self.context.sinks.keys
        if self.api is not None and keys is not None:
            self.key = keys(headers)
        return b"".join(out)

    async def _open_upstream(self, head: bytes) -> None:
        context = self.context
        try:
            transport, _ = await asyncio.wait_for(
                self.loop.create_connection(
                    lambda: _Side(self, False), context.host, context.port, ssl=context.ssl
                ),
                context.connect_timeout,
            )
        except (OSError, TimeoutError) as exc:
            if not self.ended:
                failure = relay_failure(
                    Cause.UPSTREAM_BROKE,
                    after_headers=False,
                    exc=exc,
                    limit=context.connect_timeout,
                )
                assert failure.answer is not None
                self._answer(*failure.answer)
                self.end("upstream_unreachable")
            return
        except asyncio.CancelledError:
            return
        if self.ended:
            transport.close()
            return
        self._last = self.loop.time()
        self._idle = self.loop.call_later(context.idle_timeout, self._check_idle)
        transport.write(head)  # the client stays unread until the 101 (_opened)

    def _answer(self, status: int, kind: str, message: str) -> None:
        """The proxy's own error answer, only while no upstream byte reached the client."""
        if self._relayed or self.client.is_closing():
            return
        body = error_body(status, kind, message, shape=error_shape(self.path))
        reason = _REASONS.get(status, b"Error")
        self.client.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (status, reason, len(body), body)
        )

    def response_head(self, status: int, extensions: str | None) -> None:
        self._status = status
        if status == 101:
            self._extensions = extensions

    def response_done(self) -> None:
        if self._status >= 200:  # a refusal's body has ended (a 1xx is followed by more)
            self.end("refused")

    def _opened(self, after: bytes, now: float) -> None:
        """The upstream answered 101: frames from here on, and the client's held bytes go."""
        self.open = True
        self._response = None
        self.upstream_bounds.feed(after)
        self._follow(after, now)
        held, self._held = self._held, []
        if held:
            self.from_client(b"".join(held))
        self._resume(True)

    def _follow(self, after: bytes, now: float) -> None:
        """On a path with a WebSocket API, start its session and frame readers."""
        if self.api is None:
            return
        try:
            deflate: DeflateParams | None = deflate_params(self._extensions)
            limit = self.context.max_message_bytes
            self._readers = (FrameReader(True, deflate, limit), FrameReader(False, deflate, limit))
            sinks, key = self.context.sinks, self.key
            self._session = self.api.open(
                start=self.start,
                started_at=self.started_at,
                path=self.path,
                query=self.query,
                record=lambda m: sinks.record(m, key),
            )
        except FrameError:
            self._stop_watching("ws_frames")
            return
        except Exception:
            log.exception("opening a WebSocket session's measurement failed")
            self._stop_watching("observe")
            return
        self._watch(False, after, now)

    # -- the byte path ------------------------------------------------------------------

    def from_client(self, data: bytes) -> None:
        upstream = self.upstream
        if upstream is None or not self.open:
            # Reading is paused until the 101; a read already under way when it paused
            # is held with the rest (_opened sends it).
            self._held.append(data)
            return
        self._last = self.loop.time()
        if self._draining and False in self._drained:
            # The upstream has our close frame: nothing may follow it. Only the client's
            # answer to its own close frame is looked for.
            self.client_bounds.feed(data)
            self._drain_step()
            return
        upstream.write(data)
        bounds = self.client_bounds
        bounds.feed(data)
        if bounds.closed and self.first_close is None:
            self.first_close = True
        if self._readers is not None:
            self._watch(True, data, perf_counter())
        if self._draining:
            self._drain_step()

    def from_upstream(self, data: bytes) -> None:
        self._last = self.loop.time()
        if self._draining and True in self._drained:  # as above, the other way
            self.upstream_bounds.feed(data)
            self._drain_step()
            return
        self.client.write(data)
        self._relayed = True
        if not self.open:
            self._read_head(data)
            return
        bounds = self.upstream_bounds
        bounds.feed(data)
        if bounds.closed and self.first_close is None:
            self.first_close = False
        if self._readers is not None:
            self._watch(False, data, perf_counter())
        if self._draining:
            self._drain_step()

    def _read_head(self, data: bytes) -> None:
        parser = self._response
        if parser is None:
            return
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            offset = exc.args[0] if exc.args else len(data)
            if self._status == 101:
                self._opened(data[offset:], perf_counter())
            else:  # an Upgrade header on a final response: not a tunnel
                self._response = None
        except httptools.HttpParserError:
            # Not HTTP the proxy can follow: the bytes went to the client all the same;
            # the client's stay held, and the tunnel ends when either side closes.
            self._response = None

    def _watch(self, from_client: bool, data: bytes, now: float) -> None:
        """The one place measuring a session can fail; it never stops the bytes."""
        readers, session = self._readers, self._session
        if readers is None or session is None or not data:
            return
        try:
            for message in readers[0 if from_client else 1].feed(data, now):
                session.message(message)
        except FrameError as exc:
            log.warning("stopped watching a WebSocket session: %s", exc)
            self._stop_watching("ws_frames")
        except Exception:
            log.exception("measuring a WebSocket session failed")
            self._stop_watching("observe")

    def _stop_watching(self, stage: str) -> None:
        self._readers = None
        self._session = None
        self.context.sinks.count_measurement_failure(stage)

    # -- flow control -------------------------------------------------------------------

    def writes_full(self, client_side: bool, full: bool) -> None:
        """One side's write buffer passed its high-water mark (or drained below the low
        one): pause (resume) reading from the other side."""
        if full:
            self._full.add(client_side)
            self._pause(not client_side)
        else:
            self._full.discard(client_side)
            self._resume(not client_side)

    def _pause(self, client_side: bool) -> None:
        if client_side in self._paused:
            return
        transport = self.client if client_side else self.upstream
        if transport is not None and not transport.is_closing():
            self._paused.add(client_side)
            transport.pause_reading()

    def _resume(self, client_side: bool) -> None:
        if client_side not in self._paused or (not client_side) in self._full:
            return
        if client_side and not self.open:
            return  # the client's bytes wait for the upstream's 101
        transport = self.client if client_side else self.upstream
        self._paused.discard(client_side)
        if transport is not None and not transport.is_closing():
            transport.resume_reading()

    # -- the end ------------------------------------------------------------------------

    def lost(self, client_side: bool) -> None:
        if self.ended:
            return
        if not self.open:
            if client_side:
                outcome = "client_vanished"
            elif self._status >= 200:
                outcome = "refused"  # a refusal whose body ran to the connection's end
            else:
                outcome = "upstream_vanished"
        elif self.first_close is not None:
            outcome = "closed_by_client" if self.first_close else "closed_by_upstream"
        else:
            outcome = "client_vanished" if client_side else "upstream_vanished"
        if self._draining:
            outcome = "shutdown"
        self.end(outcome)

    def _check_idle(self) -> None:
        self._idle = None
        if self.ended:
            return
        if (
            self._full
            or self.client.get_write_buffer_size()
            or (self.upstream is not None and self.upstream.get_write_buffer_size())
        ):
            self._last = self.loop.time()  # a side is slow to take its bytes: not idle
        quiet = self.loop.time() - self._last
        if quiet >= self.context.idle_timeout:
            log.info("closing a WebSocket tunnel idle for %.0f s", quiet)
            self.end("idle_timeout")
        else:
            self._idle = self.loop.call_later(self.context.idle_timeout - quiet, self._check_idle)

    def shutdown(self) -> None:
        """The drain: a close frame (1001) to each side at a frame boundary, then close."""
        if self.ended or self._draining:
            return
        if not self.open:
            if not self._relayed:
                failure = relay_failure(Cause.SHUTDOWN, after_headers=False)
                assert failure.answer is not None
                self._answer(*failure.answer)
            self.end("shutdown")
            return
        self._draining = True
        if self.first_close is None:
            self._drain_step()
        self._abort_later(self._finish_drain)

    def _drain_step(self) -> None:
        """Write each side its close frame once the frames towards it are at a boundary;
        close when both sides have answered with theirs."""
        if self.first_close is not None and not self._drained:
            return  # a close handshake was already under way: let it end by itself
        if True not in self._drained and self.upstream_bounds.at_boundary:
            self.client.write(close_frame(GOING_AWAY, SHUTDOWN_REASON, masked=False))
            self._drained.add(True)
            self.upstream_bounds = FrameBounds()  # now: the upstream's answer
        if False not in self._drained and self.client_bounds.at_boundary:
            assert self.upstream is not None
            self.upstream.write(close_frame(GOING_AWAY, SHUTDOWN_REASON, masked=True))
            self._drained.add(False)
            self.client_bounds = FrameBounds()  # now: the client's answer
        if len(self._drained) == 2 and self.client_bounds.closed and self.upstream_bounds.closed:
            self.end("shutdown")

    def _finish_drain(self) -> None:
        if not self.ended:
            self.end("shutdown")

    def end(self, outcome: str) -> None:
        """Close both sides and count the session, once."""
        if self.ended:
            return
        self.ended = True
        self.outcome = outcome
        now = perf_counter()
        for timer in (self._idle, self._abort):
            if timer is not None:
                timer.cancel()
        if self._connect is not None and not self._connect.done():
            self._connect.cancel()
        for transport in (self.client, self.upstream):
            if transport is not None and not transport.is_closing():
                transport.close()
        self._abort_later(self._abort_both)
        self.context.tunnels.discard(self)
        self._in_flight.dec()
        self._outcomes[outcome].inc()
        self._duration.observe(now - self.start)
        session, self._session, self._readers = self._session, None, None
        if session is not None:
            try:
                session.close(now, outcome if outcome in CLOSE_CAUSES else "error")
            except Exception:
                log.exception("finishing a WebSocket session's measurement failed")
                self.context.sinks.count_measurement_failure("finish")
        if not self.closed.done():
            self.closed.set_result(outcome)

    def _abort_later(self, then: Callable[[], None]) -> None:
        if self._abort is not None:
            self._abort.cancel()
        self._abort = self.loop.call_later(self.context.close_grace, then)

    def _abort_both(self) -> None:
        """A side that would not take its last bytes within close_grace is cut."""
        self._abort = None
        for transport in (self.client, self.upstream):
            if transport is not None and transport.get_write_buffer_size():
                transport.abort()


class _ResponseHead:
    """httptools callbacks for the upstream's response head (and a refusal's body end)."""

    __slots__ = ("_extensions", "_tunnel")

    def __init__(self, tunnel: Tunnel) -> None:
        self._tunnel = tunnel
        self._extensions: list[bytes] = []

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"sec-websocket-extensions":
            self._extensions.append(value)

    def on_headers_complete(self) -> None:
        parser = self._tunnel._response
        status = parser.get_status_code() if parser is not None else 0
        extensions = b", ".join(self._extensions).decode("latin-1") if self._extensions else None
        self._extensions = []
        self._tunnel.response_head(status, extensions)

    def on_message_complete(self) -> None:
        self._tunnel.response_done()


_REASONS = {
    400: b"Bad Request",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
}

__all__ = [
    "TunnelContext",
    "TunnelHandle",
    "is_websocket_upgrade",
    "take_over",
    "tunnel_context",
]
