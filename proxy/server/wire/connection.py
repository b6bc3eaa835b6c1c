"""The wire's client side: one protocol per client connection, one `WireRequest` per request.

`WireProtocol` is uvicorn's httptools protocol with the head limits
(proxy/server/protocol.py), so uvicorn stays the server (sockets, workers, signals, the
drain) and llhttp parses the requests. At each request head it decides, by the control
plane's one set lookup (`ControlPlane.owns`): the proxy's own paths go through uvicorn's
usual ASGI cycle to the Starlette control plane; every other request becomes a
`WireRequest`, which takes the place of uvicorn's cycle on the connection (keep-alive,
pipelining, the drain all keep working) and relays with no ASGI message at all. Both
decisions are made on the normalised target (`own_route`), so `/v1/../metrics` is the
proxy's /metrics, never the backend's. A well-formed WebSocket handshake to any other
path is handed, its head as llhttp parsed it, to the WebSocket tunnel
(proxy.server.tunnel.take_over) once the responses before it on the connection have
ended (proxy/server/protocol.py); any other Upgrade is relayed as plain HTTP, the Upgrade
header stripped as hop-by-hop, and the connection closes after its response.

A `WireRequest`'s life: admission (proxy/server/admission.py), the body, the measured
exchange (proxy/server/exchange.py, shared with the ASGI relay), an upstream connection
from the pool (proxy/server/wire/upstream.py), the response head, the body chunk by chunk
(in the upstream connection's callback), and `done`. It ends early through `cut` (client
gone, idle or first-byte timeout, shutdown) or `upstream_broke`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from time import perf_counter, time
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from proxy.core.errors import Cause, Ending, Failure, LostTurn, fault_words
from proxy.core.paths import Target
from proxy.core.strip import UsageEventStripper
from proxy.server.admission import BODY_TIMEOUT, Refused, answer_bytes, own_route, where_to
from proxy.server.backlog import Progress, reset
from proxy.server.deadline import Deadline
from proxy.server.exchange import Context
from proxy.server.headers import Headers, client_address
from proxy.server.protocol import GuardedHttpToolsProtocol, bodiless
from proxy.server.rules import ExchangeRules, Stage
from proxy.server.tunnel.registry import OpenTunnels
from proxy.server.upstream import RESEND_WITHIN
from proxy.server.upstream_errors import UpstreamClosed
from proxy.server.wire.upstream import (
    LAST_CHUNK,
    Pool,
    UpstreamConnection,
    frame_chunk,
    reads_to_close,
)

log = logging.getLogger("tokenprobe")

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_WITH_BODY = frozenset({b"POST", b"PUT", b"PATCH"})


class Wire:
    """What every wire connection of a server shares: the exchanges' context, the
    upstream pool, the control plane's paths, the requests in flight (`receiving` their
    body, their turn come; `active` upstream) and the tunnels."""

    def __init__(
        self, context: Context, owns: Callable[[str], bool], tunnel_context: object = None
    ) -> None:
        self.context = context
        self.owns = owns
        self.pool = Pool(
            context.upstream,
            context.settings.connect_timeout,
            context.sinks.count_upstream_protocol_error,
            context.settings.upstream_ssl,
        )
        self.active: set[WireRequest] = set()
        self.receiving: set[WireRequest] = set()
        self.connecting: set[asyncio.Task[None]] = set()
        # The tunnels' own registry (each tunnel joins it as it starts and leaves once
        # counted), so the test listener (tests/ws_proxy.py) drains through this one too.
        tunnels = getattr(tunnel_context, "tunnels", None)
        self.tunnels = tunnels if isinstance(tunnels, OpenTunnels) else OpenTunnels()
        self.tunnel_context = tunnel_context

    def close(self) -> None:
        """The server is stopping and its drain time is over: cut what is still in flight.
        A request still receiving its body gets the 503 a request waiting for its answer
        gets; one pipelined behind another is dropped with the connection (its record is
        made as the connection closes: WireProtocol.connection_lost)."""
        for request in list(self.receiving):
            request.shut_out()
        for request in list(self.active):
            request.cut(Cause.SHUTDOWN)
        self.tunnels.shutdown_all()
        self.pool.close()


#: The lifespan state key of the served app's Wire (uvicorn hands it to each connection
#: as `app_state`; proxy/server/app.py fills it in at startup).
WIRE_STATE = "tokenprobe.wire"


class WireProtocol(GuardedHttpToolsProtocol):
    """A client connection: the control plane through uvicorn's cycle, the rest on the wire."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wire: Wire | None = None
        self._tunnel: Any = None
        # a handshake head's arrival (perf_counter(), time()) and its target as parsed
        # here, once: _switch hands both to the tunnel
        self._ws_head: tuple[float, float, Target | Refused] | None = None
        self.peer_address: str | None = None  # the client's, read once a connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.peer_address = client_address(self.client)  # uvicorn's (host, port), or None
        wire = self.app_state.get(WIRE_STATE)
        self.wire = wire if isinstance(wire, Wire) else None  # None: everything to the app

    def on_headers_complete(self) -> None:
        wire = self.wire
        if wire is None:  # no lifespan ran: everything goes to the app
            super().on_headers_complete()
            return
        self._head_done()
        parser = self.parser
        upgrade = parser.should_upgrade()
        parsed = httptools.parse_url(self.url)
        raw_path = parsed.path
        where = where_to(raw_path, parsed.query or b"")
        own = own_route(where, wire.owns)
        self._ws = own is None and self._is_handshake()
        self._body_due = self._upgrade_body()
        if self._ws:  # stamped as a WireRequest is: the session's time runs from here
            self._ws_head = (perf_counter(), time(), where)
        if self._ws or own is not None:
            # A tunnel (see _switch), or the proxy's own route through uvicorn's cycle
            # (ProxyApp routes it on the same normalised target).
            HttpToolsProtocol.on_headers_complete(self)
            self.headers = []  # trailers, if any, land here, not in the scope
            return
        version = parser.get_http_version()
        request = WireRequest(
            self,
            wire,
            parser.get_method(),
            raw_path,
            where,
            self.headers,
            http_11=version == "1.1",
            keep_alive=version != "1.0" and parser.should_keep_alive() and not upgrade,
            expect_100=self.expect_100_continue,
        )
        self.headers = []  # trailers of a chunked body, if any, land elsewhere
        existing = self.cycle
        self.cycle = request  # type: ignore[assignment]
        if existing is None or existing.response_complete:
            request.begin()
        else:  # pipelined: its turn comes when the response before it ends
            if self.pipeline or request.rules.stage is not Stage.RECEIVING:
                # A second one waiting (or one refused already): nothing more is read
                # until a turn comes. With one, reading goes on (its body, bounded as any),
                # so a client that leaves is seen and the running request's upstream
                # request cancelled at once. What one read brings is parsed whole, so
                # the waiting are bounded by MAX_WAITING instead (protocol.py).
                self.flow.pause_reading()
            self.pipeline.appendleft((request, self.app))  # type: ignore[arg-type,unused-ignore]

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        if isinstance(cycle, WireRequest):
            cycle.begin()
        else:
            super()._start_asgi_task(cycle, app)

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if isinstance(cycle, WireRequest):
            self._fed, self._dry_bytes = True, 0  # as GuardedHttpToolsProtocol.on_body
            cycle.on_body(body)
        else:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._body_due is not None:  # llhttp skipped an upgrade request's body
            return
        cycle = self.cycle
        if isinstance(cycle, WireRequest):
            cycle.on_message_complete()
            self._body_done()
        else:
            super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        # The running request (its upstream request cancelled, so the backend frees its
        # KV cache), the one parsed last and those waiting behind it (dropped by the
        # drain's end, or their client gone).
        running, self.running = self.running, None  # both refer back to this protocol
        cycle: Any = self.cycle
        lost = self.lost_turn(exc)
        if isinstance(running, WireRequest) and running is not cycle:
            running.client_gone()
        if isinstance(cycle, WireRequest):
            self.cycle = None  # type: ignore[assignment,unused-ignore]
            cycle.client_gone(lost)
        for waiting, _ in self.pipeline:
            if isinstance(waiting, WireRequest):
                waiting.client_gone(lost)
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        running = self.running
        if isinstance(running, WireRequest) and running.upstream is not None:
            running.upstream.pause()

    def resume_writing(self) -> None:
        super().resume_writing()
        running = self.running
        if isinstance(running, WireRequest) and running.upstream is not None:
            running.upstream.resume()

    def shutdown(self) -> None:
        if self._tunnel is not None:
            # The drain's close frames both ways; uvicorn waits for the tunnel's `closed`
            # (its callback, set in _switch, leaves the connection set) up to the drain.
            self._tunnel.shutdown()
            return
        super().shutdown()

    # -- WebSockets -------------------------------------------------------------------

    def _switch(self, rest: bytes) -> None:
        """Hand the connection to the WebSocket tunnel: the handshake's head as llhttp
        parsed it, and what the client sent after it (the tunnel holds that until
        the upstream's 101); from here on this protocol reads nothing."""
        from proxy.server.tunnel import TunnelContext, take_over

        assert self.wire is not None
        context = self.wire.tunnel_context
        assert isinstance(context, TunnelContext)
        scope = self.scope
        self._stop_head_timer()
        self._unset_keepalive_if_required()
        assert self._ws_head is not None
        start, started_at, where = self._ws_head  # not now: its turn may have come late
        tunnel = take_over(
            self.transport,
            scope["method"].encode(),
            self.url,
            scope["headers"],
            rest,
            context,
            start=start,
            started_at=started_at,
            where=where,
        )
        self._tunnel = tunnel  # in wire.tunnels already: the tunnel joined it as it began
        closed = getattr(tunnel, "closed", None)
        if isinstance(closed, asyncio.Future):  # uvicorn's drain waits for the tunnel
            closed.add_done_callback(lambda _: self.connections.discard(self))
        else:
            self.connections.discard(self)


class WireRequest(Deadline):
    """One relayed request on a client connection, in uvicorn's cycle's place.

    uvicorn's protocol reads `response_complete` and `keep_alive` on it (pipelining, the
    drain); what the request's events mean is decided by its `ExchangeRules`
    (proxy/server/rules.py), and this object carries that out on the connection."""

    __slots__ = (
        "client_progress",
        "complete",
        "expect_100",
        "head_only",
        "http_11",
        "keep_alive",
        "method",
        "proto",
        "resend",
        "response_complete",
        "rules",
        "sent_at",
        "started",
        "stripper",
        "transport",
        "upstream",
        "wire",
    )

    def __init__(
        self,
        proto: WireProtocol,
        wire: Wire,
        method: bytes,
        raw_path: bytes,
        where: Target | Refused,
        headers: Headers,
        *,
        http_11: bool,
        keep_alive: bool,
        expect_100: bool,
    ) -> None:
        self.proto, self.wire, self.transport = proto, wire, proto.transport
        self.method = method
        self.http_11, self.keep_alive, self.expect_100 = http_11, keep_alive, expect_100
        self.head_only = method == b"HEAD"
        self.response_complete = False
        self.started = False  # its turn on the connection came
        self.complete = False  # its whole body is in
        self.upstream: UpstreamConnection | None = None
        self.resend = b""  # the request, while it went out on a reused connection unanswered
        self.stripper: UsageEventStripper | None = None
        Deadline.__init__(self)  # see time_left
        self.sent_at = 0.0  # when the request went upstream; 0.0 until then
        # Whether the client still takes bytes while it holds the upstream up: made at the
        # first look of a hold-up (_check), as few requests ever have one.
        self.client_progress: Progress | None = None
        context = wire.context
        self.rules = ExchangeRules(
            context,
            method.decode("latin-1"),
            where,
            raw_path,
            headers,
            perf_counter(),
            time(),
            proto.peer_address,
        )

    # -- the request ------------------------------------------------------------------

    def begin(self) -> None:
        """Its turn on the connection: answer a refusal, or go upstream once the body is in.
        The body's time runs from here: a pipelined request's body cannot come while the
        connection is not read for it."""
        self.started = True
        self.proto.running = self
        if not self.complete:
            self.due_within(self.wire.context.settings.body_timeout)
        stage = self.rules.stage
        if stage is Stage.REFUSED:
            self._answer_refusal()
        elif self.complete:
            self._send()
        else:
            self.wire.receiving.add(self)  # until it goes upstream or ends (Wire.close)
            if self.expect_100 and not self.transport.is_closing():
                self.transport.write(_CONTINUE)  # as uvicorn does when an app reads the body
            self.expect_100 = False  # answered, or never asked: the body comes

    def on_body(self, body: bytes) -> None:
        if self.rules.body(body) is not None:
            self._refused()

    def on_message_complete(self) -> None:
        self.complete = True
        if self.started and self.rules.stage is Stage.RECEIVING:
            self._send()

    def _refused(self) -> None:
        self.wire.receiving.discard(self)
        self.cancel_deadline()  # the rest of its body is the connection's to bound (protocol.py)
        if self.started:
            self._answer_refusal()
        else:  # waiting its turn: the rest of its body waits too (read and dropped then)
            self.proto.flow.pause_reading()

    # -- the request's one timer ------------------------------------------------------

    def time_left(self) -> float | None:
        """The one timer of a request (proxy/server/deadline.py), armed when its turn comes:
        instead of a timer per wait (the body, the first byte, the upstream's silence),
        each armed and cancelled per request, this one looks at the wait the request is
        in when it fires and, while that wait is younger than its limit, says how long it
        has left. A request that ends within --body-timeout arms one timer and cancels it."""
        if self.response_complete:
            return None
        if not self.complete:  # the body did not come in --body-timeout
            self.rules.refuse(BODY_TIMEOUT)
            self._refused()
            return None
        if not self.sent_at:  # the body is in, waiting its turn on the connection: none
            return None  # of the waits is on (`_send` arms the timer again)
        if self.rules.stage is not Stage.RESPONDING:  # waiting for the response head
            limit = self.wire.context.settings.first_byte_timeout
            waited, cause = perf_counter() - self.sent_at, Cause.FIRST_BYTE_TIMEOUT
        else:  # the body: from the upstream's last read, or the client's, while it holds
            conn = self.upstream  # the upstream up
            limit, cause = self.wire.context.settings.idle_timeout, Cause.IDLE_TIMEOUT
            if conn is None:
                waited = 0.0
            elif conn.paused:  # the client holds it up: one that stopped reading and stays
                # would hold the backend's generation, and its KV cache, for good
                progress = self.client_progress
                if progress is None:
                    progress = self.client_progress = Progress()
                waited = progress.stalled_for(conn.now, self.transport, perf_counter())
                cause = Cause.CLIENT_STALLED
            else:
                waited = perf_counter() - conn.now
        if waited >= limit:
            self.cut(cause)
            return None
        return limit - waited

    def _answer_refusal(self) -> None:
        rules = self.rules
        refusal = rules.refusal
        assert refusal is not None
        rules.refused()
        if rules.refusal_closes(self.expect_100, self.complete):
            self.keep_alive = False
        self._answer(refusal.status, refusal.kind, refusal.message)
        self._response_over()

    def _send(self) -> None:
        """The request goes upstream: admitted, measured, on a pooled connection."""
        wire = self.wire
        rules = self.rules
        # The request is in: the proxy's own time starts (overhead).
        upstream = rules.admit(perf_counter())
        exchange = rules.exchange
        assert exchange is not None
        self.stripper = rules.stripper
        wire.receiving.discard(self)
        wire.active.add(self)
        body = upstream.body
        lines = [
            b"%s %s HTTP/1.1\r\nhost: %s\r\n"
            % (self.method, upstream.target.encode(), wire.pool.authority)
        ]
        lines.extend(b"%s: %s\r\n" % pair for pair in upstream.headers)
        if body or self.method in _WITH_BODY:
            lines.append(b"content-length: %d\r\n" % len(body))
        lines.append(b"\r\n")
        lines.append(body)
        head = b"".join(lines)
        self.sent_at = now = perf_counter()
        exchange.sent(now)
        self.due_within(exchange.context.settings.first_byte_timeout)
        conn = wire.pool.take()
        if conn is not None:
            self.resend = head
            self._on_upstream(conn, head)
        else:
            self._connect_soon(head)

    def _connect_soon(self, head: bytes) -> None:
        connecting = self.wire.connecting  # a reference, or the loop may drop the task
        task = self.proto.loop.create_task(self._connect(head))
        connecting.add(task)
        task.add_done_callback(connecting.discard)

    async def _connect(self, head: bytes) -> None:
        try:
            conn = await self.wire.pool.connect()
        except Exception as exc:  # unreachable, refused, timed out: the client gets a 50x
            self.upstream_broke(exc)
            return
        if self.response_complete:  # cut while connecting: the connection is clean
            self.wire.pool.put(conn)
            return
        self._on_upstream(conn, head)

    def _on_upstream(self, conn: UpstreamConnection, head: bytes) -> None:
        self.upstream = conn
        conn.start(self, head)
        if self.proto.flow.write_paused:
            conn.pause()

    # -- the response (called by the upstream connection) -----------------------------

    def response_head(self, status: int, headers: Headers, now: float) -> None:
        self.resend = b""
        conn, exchange = self.upstream, self.rules.exchange
        assert conn is not None and exchange is not None
        head = self.rules.response_head(status, headers, now)
        stripper = self.stripper = head.stripper
        out = head.headers
        no_body = self.head_only or bodiless(status)
        chunked = not no_body and (stripper is not None or not head.length)
        if chunked and not self.http_11:  # an HTTP/1.0 client: the body ends with the connection
            chunked, self.keep_alive = False, False
        if chunked:
            out.append((b"transfer-encoding", b"chunked"))
        if not self.keep_alive:
            out.append((b"connection", b"close"))
        lines = [STATUS_LINE[status]]
        lines.extend(b"%s: %s\r\n" % pair for pair in out)
        lines.append(b"\r\n")
        self.transport.write(b"".join(lines))
        exchange.relayed(perf_counter())
        if no_body:
            if self.head_only:  # it ends at its head, whatever its framing says; its
                # connection is never pooled: a body a broken server sends after it,
                # late, would be the next request's answer (UpstreamConnection.release)
                self.response_end(now, False)
            return
        conn.write = self.transport.write
        conn.chunked = chunked
        conn.strip = None if stripper is None else stripper.feed
        conn.feed = exchange.feed
        self.due_within(exchange.context.settings.idle_timeout)

    def response_end(self, now: float, reusable: bool) -> None:
        """The upstream body ended cleanly."""
        conn, exchange = self.upstream, self.rules.exchange
        assert conn is not None and exchange is not None
        if self.stripper is not None and (rest := self.stripper.flush()):
            conn.write(frame_chunk(rest) if conn.chunked else rest)
        if conn.chunked:
            self.transport.write(LAST_CHUNK)
        exchange.end_of_stream(now)
        self.upstream = None
        conn.release(reusable)
        self._done(None)

    def upstream_lost(self, exc: Exception | None) -> None:
        """The upstream closed the connection: the end of a body read to the close, or a
        break; or, before any byte of answer on a reused connection, a resend."""
        conn, head = self.upstream, self.resend
        if (
            conn is not None
            and head
            and exc is None
            and not conn.answered
            and perf_counter() - self.sent_at < RESEND_WITHIN
        ):
            # The backend closed a kept-alive connection as the request went out on it,
            # before a byte of answer: it closed an idle connection and never took the
            # request (llama.cpp's server closes after every stream though its head says
            # Keep-Alive: docs/llamacpp.md). The request goes once more, on a new one.
            self.upstream, self.resend = None, b""
            self._connect_soon(head)
            return
        if conn is not None and not conn.in_head and exc is None and reads_to_close(conn.headers):
            # Only a clean close ends such a body (RFC 9112 §6.3, item 8); a reset cut it
            # short (§8), and the client must not get its last chunk: a break, as below.
            self.response_end(perf_counter(), False)
            return
        self.upstream_broke(exc or _closed_early(conn))

    def upstream_broke(self, exc: BaseException) -> None:
        self._end_early(Cause.UPSTREAM_BROKE, exc)

    # -- early ends -------------------------------------------------------------------

    def cut(self, cause: Cause) -> None:
        """Client gone, a timeout, or shutdown: the upstream connection closes at once
        (never pooled), so the backend aborts the generation; reset, where the backend
        has not taken all of the request yet (UpstreamConnection.abandon)."""
        self._end_early(cause)

    def client_gone(self, lost: LostTurn = LostTurn.CLIENT) -> None:
        """The connection closed (connection_lost): the client left, or the proxy closed
        it; for a request still waiting its turn, `lost` says why it never came, and its
        record says so, one refused at its head too (its refusal never went out)."""
        if self.rules.exchange is not None:
            self._end_early(Cause.CLIENT_GONE)
            return
        self.cancel_deadline()
        self.wire.receiving.discard(self)
        if self.response_complete:
            return
        stage = self.rules.stage
        if self.started:  # its body was coming in when the client left
            if stage is Stage.RECEIVING:
                self.response_complete = True
                self.rules.abandoned()
        elif stage is Stage.RECEIVING or stage is Stage.REFUSED:
            self.response_complete = True
            self.rules.turn_lost(lost)

    def shut_out(self) -> None:
        """The drain time ran out while its body was still coming in: the proxy's 503
        (proxy_shutting_down), and the connection closes after it."""
        self.wire.receiving.discard(self)
        self.cancel_deadline()
        if self.response_complete or self.rules.stage is not Stage.RECEIVING:
            return
        self._end_connection(self.rules.shut_out())
        self._response_over()

    def _end_early(self, cause: Cause, exc: BaseException | None = None) -> None:
        if self.response_complete or self.rules.exchange is None:
            return
        conn, self.upstream = self.upstream, None
        chunked = conn is not None and conn.chunked  # the close forgets it
        if conn is not None:
            conn.abandon()
        failure = self.rules.early_end(cause, exc)
        if (held := self.rules.held(failure)) and not self.transport.is_closing():
            # What the usage stripper held (a finish chunk that waited for the usage
            # chunk): after every byte written so far (each read's went out as it was
            # read) and before the drop, as the client would have had it direct.
            self.transport.write(frame_chunk(held) if chunked else held)
        self._end_connection(failure)
        self._done(failure)

    def _end_connection(self, failure: Failure) -> None:
        """The client's answer, if any, and the connection's end as the failure decided
        it (proxy.core.errors.Ending); the close itself comes with `_response_over`."""
        ending = failure.ending
        if ending is not Ending.KEEP:
            self.keep_alive = False  # before the answer, so that it says Connection: close
            if ending is Ending.ABORT:  # a close would wait for good on what it never takes,
                reset(self.transport)  # and an abort leave the kernel's queue (backlog.py)
            elif ending is Ending.CUT:  # for the requests pipelined behind (protocol.py)
                self.proto.answer_cut = True
        if failure.answer is not None:
            self._answer(*failure.answer)

    def _done(self, failure: Failure | None) -> None:
        self.cancel_deadline()
        self.wire.active.discard(self)
        exchange = self.rules.exchange
        assert exchange is not None
        exchange.finish_soon(failure)
        self._response_over()

    def _response_over(self) -> None:
        self.response_complete = True
        if not self.keep_alive:
            self.transport.close()
        self.proto.on_response_complete()  # the next pipelined request, or keep-alive

    def _answer(self, status: int, kind: str, message: str) -> None:
        if self.transport.is_closing():
            return
        self.transport.write(
            answer_bytes(
                status,
                kind,
                message,
                self.rules.route,  # its API's error shape, after --root-path
                close=not self.keep_alive,
                head_only=self.head_only,
            )
        )


def _closed_early(conn: UpstreamConnection | None) -> UpstreamClosed:
    """A clean close (the transport saw a FIN: `connection_lost(None)`) that cut the
    response short, named for what it cut. A reset comes with the system's
    ConnectionResetError, which is the record's words for it."""
    if conn is None or not conn.answered:
        where = "before answering"
    elif conn.in_head:
        where = "before the end of the response head"
    else:
        where = "before the end of the response body"
    return UpstreamClosed(fault_words("closed_early", where=where))
