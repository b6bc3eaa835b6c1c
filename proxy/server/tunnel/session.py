"""One tunnel: the handshake, the pipe and the watch together, its outcome and its end.

`take_over` starts it with a client connection the wire stopped parsing at a WebSocket
handshake's head:

1. The head is admitted (handshake.py `admit`); one that is not gets the HTTP relay's
   400 `invalid_request_target`, and the session that outcome. One that would open more
   tunnels than --ws-max-tunnels (`over_cap`) gets a 503 `too_many_websockets` with
   `Retry-After`, nothing sent upstream. The upstream is
   connected (--connect-timeout) and sent the handshake; an unreachable one gets the
   client the proxy's 502/504 (proxy.core.errors.relay_failure), as an HTTP request would;
   so does one that closes before its final answer began, or sends no final answer
   within --first-byte-timeout of the handshake going upstream (its connect included,
   as an HTTP request's first-byte wait includes its connect): interim (1xx) heads went
   to the client as they came, and a 504 after them is still HTTP/1.1, as the HTTP
   path's 504 is after the 1xx heads it drops.
2. Nothing the client sent after its head goes upstream before the upstream's 101: the
   pipe holds the client's bytes, since the upstream might refuse the upgrade and read
   them as a request the proxy never parsed. The upstream's answer goes to the client
   once its head is whole (`AnswerHead`, the pipe's gate: a refusal's redirect into the
   upstream then points at the proxy, as on HTTP), read on the side (`UpstreamAnswer`).
   A 101 opens the tunnel, the frames after it go as they arrive, and the held bytes
   go; any other final status (a refusal) reaches the client as llhttp reads it, as
   the wire relays an HTTP response: its head with `connection: close`, its body to its
   end, and both connections close when its body ends, or when it sends nothing for
   --idle-timeout before that end, as the HTTP relay cuts a response body that goes
   quiet (a body with no length ends at that close; the session is still `refused`, and
   its record has the cut's error, as an HTTP record has). Bytes after that end (a second
   response, which a client that pipelined a request behind the handshake would take
   for its answer) reach no client, counted `extra_bytes` as on HTTP. An answer llhttp
   refuses is counted malformed and ends the session (outcome error), as the HTTP relay
   closes such a connection; a head it refuses is held back, and the client gets the
   HTTP relay's 502 "malformed response: ..." instead.
3. Open, every read goes to the other side first, then to the watch (watch.py).
4. The end: either side's connection ending closes the other at once (pipe.py); a side
   that only ends its sending (a TCP half-close: a client's close frame, then its FIN)
   has it passed on, and the other side's answer still reaches it: the tunnel ends when
   the other side ends too, or close_grace after the FIN (a TLS side's own close_notify
   or FIN cannot be kept: asyncio's TLS transport closes at it, pipe.py). So does
   --ws-idle-timeout with no byte either way, timed from the upstream's 101 (before any
   final answer, --first-byte-timeout's 504 is the limit; a refusal's, --idle-timeout).
   `TunnelHandle.shutdown` (the drain on SIGTERM) is the watch's close frames both ways,
   then the close, or after close_grace.

Each session goes to the sinks twice: `Sinks.session_started` once admitted (in flight),
`Sinks.session_ended` with its record (proxy/core/wsrecord.py) when it ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from time import perf_counter, time

from proxy.core.errors import (
    Cause,
    Ending,
    Failure,
    classify_response,
    error_message,
    relay_failure,
)
from proxy.core.measurement import ErrorType, Measurement
from proxy.core.paths import Target
from proxy.core.secrets import redact
from proxy.core.wsrecord import OTHER_ROUTE, WsSessionRecord
from proxy.core.wsseam import WsApi, WsSession
from proxy.server.admission import Refused, answer_bytes
from proxy.server.backlog import reset
from proxy.server.dial import dial
from proxy.server.headers import Headers, client_address, redirect_ends
from proxy.server.tunnel.context import TunnelContext
from proxy.server.tunnel.handshake import AnswerHead, UpstreamAnswer, admit
from proxy.server.tunnel.pipe import Pipe
from proxy.server.tunnel.watch import WsWatch
from proxy.server.upstream_errors import UpstreamClosed, UpstreamProtocolError

log = logging.getLogger("tokenprobe")

#: The most of an upstream's error text a record keeps (after masking: `_record`).
ERROR_TEXT = 200

#: The error kind of the answer to a handshake past --ws-max-tunnels.
SHED_KIND = "too_many_websockets"
#: Its session's outcome (proxy/core/wsrecord.py WS_OUTCOMES): the answer's kind.
SHED_OUTCOME = SHED_KIND
#: Seconds its Retry-After says: a session ends at any moment, and a refused handshake
#: costs the proxy one small answer, nothing upstream.
RETRY_AFTER = 1


def over_cap(context: TunnelContext) -> bool:
    """More tunnels open than --ws-max-tunnels, this one (registered at its start)
    included."""
    return len(context.tunnels) > context.ws_max_tunnels


def shed_answer(message: str, path: str) -> bytes:
    """The proxy's 503 for a handshake past the cap: the HTTP relay's error answer for
    this path's API shape (`answer_bytes`), with a Retry-After, and the connection
    closes after it."""
    answer = answer_bytes(503, SHED_KIND, message, path, close=True)
    line = answer.index(b"\r\n") + 2  # after the status line
    return b"%sretry-after: %d\r\n%s" % (answer[:line], RETRY_AFTER, answer[line:])


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
    method: bytes,
    request_target: bytes,
    headers: Iterable[tuple[bytes, bytes]],
    rest: bytes,
    context: TunnelContext,
    *,
    start: float | None = None,
    started_at: float | None = None,
    where: Target | Refused | None = None,
) -> TunnelHandle:
    """Tunnel this client connection to the upstream. `method`, `request_target` and
    `headers` are the head of a request `is_websocket_upgrade` accepted, as parsed; `rest`
    what the client sent after it; `start` and `started_at` the perf_counter() and time()
    of the head's arrival (default: now), taken as an HTTP request's are: a handshake
    pipelined behind a slow response is timed from its arrival, not from its turn;
    `where` the target as the wire normalised it at the head (None: parsed here)."""
    if start is None:
        start = perf_counter()
    if started_at is None:  # the same instant on the wall clock
        started_at = time() - (perf_counter() - start)
    tunnel = Tunnel(transport, context, start, started_at)
    tunnel.begin(method, request_target, headers, rest, where)
    return TunnelHandle(tunnel)


class Tunnel:
    """One WebSocket session: its handshake, its pipe, its watch, and how it ended."""

    def __init__(
        self, client: asyncio.Transport, context: TunnelContext, start: float, started_at: float
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.context = context
        # The head's arrival: the session's duration, its log line's ts and its turns'
        # wall-clock starts (realtime.py) all count from this one pair.
        self.start, self.started_at = start, started_at
        self.closed: asyncio.Future[str] = self.loop.create_future()
        self.outcome: str | None = None
        self.route = OTHER_ROUTE
        self.path = "/"
        self.query = ""
        self.headers: Headers = []
        self.api: WsApi | None = None
        self.key: str | None = None
        self.open = False  # the upstream answered 101
        self.ended = False
        self._status = 0  # the proxy's own answer's status, when it gave one
        self._error: str | None = None  # and why, for the session's record
        self._cut: Failure | None = None  # a refusal cut before its body's end (`_stalled`)
        self._connect: asyncio.Task[None] | None = None
        self._unanswered: asyncio.TimerHandle | None = None  # --first-byte-timeout's
        self._answering = False  # the upstream's final answer began: the idle timer runs
        self._head: AnswerHead | None = None  # the gate on the answer's heads, once admitted
        context.tunnels.add(self)
        self.pipe = Pipe(client, self, context.close_grace)  # the client's reads held
        self.answer = UpstreamAnswer(refused=lambda: self.end("refused"))
        self.watch = WsWatch(self.pipe, context.sinks.count_measurement_failure, self._drained)

    # -- the handshake ------------------------------------------------------------------

    def begin(
        self,
        method: bytes,
        request_target: bytes,
        headers: Iterable[tuple[bytes, bytes]],
        rest: bytes,
        where: Target | Refused | None = None,
    ) -> None:
        sinks = self.context.sinks
        try:
            client = client_address(self.pipe.client.get_extra_info("peername"))
            admitted = admit(method, request_target, headers, self.context.upstream, client, where)
        except Refused as refusal:
            sinks.session_started(self.route)
            self._answer(refusal.status, refusal.kind, refusal.message)
            if self._status:  # the record says why, as an upstream failure's does
                self._error = self._masked(refusal.message)
            self.end(refusal.kind)  # invalid_request_target, HTTP's kind for this target
            return
        self.path, self.query = admitted.path, admitted.query
        self.headers = admitted.headers  # for records: credentials to redact, a traceparent
        self.api = self.context.apis(self.path)
        if self.api is not None:
            self.route = self.api.endpoint
            if sinks.keys is not None:
                self.key = sinks.keys(admitted.headers)
        sinks.session_started(self.route)
        if over_cap(self.context):
            self._shed()
            return
        self._hold_answer_head(admitted.headers)
        if rest:
            self.pipe.hold(rest)
        self._connect = self.loop.create_task(self._open_upstream(admitted.request))
        # --first-byte-timeout runs from here, the connect included, as an HTTP request's
        # runs from its going upstream (the wire's `_send`, forward.py `send_request`):
        # a slow connect gets the client the same 504 at the same bound. The idle timer
        # judges what follows the answer's first byte (`seen`): one from here would cut
        # a handshake that waits longer than --ws-idle-timeout with a bare close.
        self._unanswered = self.loop.call_later(self.context.first_byte_timeout, self._no_answer)

    def _shed(self) -> None:
        """More tunnels open than --ws-max-tunnels: this one is answered 503 before
        anything goes upstream, counted (`SHED_OUTCOME`) and said."""
        limit = self.context.ws_max_tunnels
        message = f"the proxy has {limit} WebSocket sessions open (--ws-max-tunnels); retry later"
        client = self.pipe.client
        if not client.is_closing():
            client.write(shed_answer(message, self.path))
            self._status = 503
        self._error = message
        self.context.tunnels.shedding(limit)
        self.end(SHED_OUTCOME)

    async def _open_upstream(self, request: bytes) -> None:
        context = self.context
        upstream = context.upstream
        try:
            transport, _ = await dial(
                self.loop,
                self.pipe.upstream_protocol,
                upstream,
                context.ssl,
                context.connect_timeout,
            )
        except asyncio.CancelledError:  # ended while connecting (`end`)
            return
        except Exception as exc:  # what the wire's HTTP connect catches, answered alike:
            # an OSError, the timeout, or what the name raises before any socket (a DNS
            # label over 63 characters: getaddrinfo's idna codec raises UnicodeError).
            if not self.ended:
                failure = relay_failure(
                    Cause.UPSTREAM_BROKE,
                    after_headers=False,
                    exc=exc,
                    limit=context.connect_timeout,
                )
                self._answer_failure(failure)
                # the outcome the client was told: a connect timeout is its 504
                timed_out = failure.error is ErrorType.UPSTREAM_TIMEOUT
                self.end("upstream_timeout" if timed_out else "upstream_unreachable")
            return
        if self.ended:
            transport.close()
            return
        transport.write(request)  # the client stays unread until the 101 (_opened)

    def _hold_answer_head(self, headers: Headers) -> None:
        """The upstream's answer head waits until whole (the pipe's gate), for a
        refusal's Location: pointed at the proxy as the client named it (`headers`: the
        client's, names in lower case)."""
        tls = bool(self.context.ssl_certfile)
        ends = redirect_ends(self.context.upstream, tls, headers)
        self._head = head = AnswerHead(ends, past_end=self._past_end)
        pipe = self.pipe

        def gate(data: bytes) -> bytes:
            out = head(data)
            if head.released:  # a 101: the frames go as they come (a refusal's body
                pipe.gate = None  # stays gated to its end)
            return out

        pipe.gate = gate

    def _past_end(self) -> None:
        """Bytes after the end of the upstream's refusal, in the read that ended it: no
        answer to anything the client asked (a request it pipelined behind the handshake
        never went upstream), so they reached no client (AnswerHead dropped them), and
        are counted as the wire counts such bytes after an HTTP response
        (tokenprobe_upstream_protocol_errors_total{kind="extra_bytes"}). The tunnel ends
        at the refusal's end all the same (UpstreamAnswer, in the same read)."""
        self.context.sinks.count_upstream_protocol_error("extra_bytes")

    def _answered(self) -> bool:
        """Whether the upstream's final answer began to go to the client (its 1xx heads
        before it do not count: the proxy's own answer may still follow them)."""
        return self._head is not None and self._head.done

    def _no_answer(self) -> None:
        """No final answer from the upstream within --first-byte-timeout of the handshake
        going upstream (still connecting, sent, or only 1xx heads back): the client gets
        the proxy's 504, as an HTTP request would, whose wait 1xx heads do not end
        (once the final answer began, the idle timer judges the rest)."""
        if self.ended or self._answered():
            return
        failure = relay_failure(
            Cause.FIRST_BYTE_TIMEOUT, after_headers=False, limit=self.context.first_byte_timeout
        )
        self._answer_failure(failure)
        self.end("upstream_timeout")

    def _answer_failure(self, failure: Failure) -> None:
        """The proxy's answer for an upstream that failed before any byte of its answer,
        and the record's error, as an HTTP request's record has it (masked, cut)."""
        assert failure.answer is not None
        self._answer(*failure.answer)
        if self._status:
            self._error = self._masked(failure.message)

    def _masked(self, text: str) -> str:
        """`text` with any credential of the request masked (`redact`, which knows a
        value only whole), then cut to ERROR_TEXT."""
        secret = self.context.secret_headers
        return redact(text, self.headers, secret, self.query)[:ERROR_TEXT]

    def _answer(self, status: int, kind: str, message: str) -> None:
        """The proxy's own error answer, only while the upstream's final answer has not
        begun to reach the client (1xx heads may have: a final status after them is
        HTTP/1.1, RFC 9110 §15.2)."""
        client = self.pipe.client
        if self._answered() or client.is_closing():
            return
        # The HTTP relay's answer and body for this path's API shape; the connection closes.
        client.write(answer_bytes(status, kind, message, self.path, close=True))
        self._status = status

    def _opened(self, after: bytes, now: float) -> None:
        """The upstream answered 101: frames from here on, and the client's held bytes go."""
        self.open = True
        self.watch.start(after, now)
        if self.api is not None:
            context = self.context
            self.watch.follow(
                self.answer.extensions,
                context.max_message_bytes,
                self._session,
                after,
                now,
                context.held,
            )
        self.pipe.release()

    def _session(self) -> WsSession:
        assert self.api is not None
        return self.api.open(
            start=self.start,
            started_at=self.started_at,
            path=self.path,
            query=self.query,
            record=self._record,
        )

    def _record(self, m: Measurement) -> None:
        """A session's record to the sinks, with any credential the upstream echoed in its
        error text masked, as the HTTP relay masks a response's (`redact`), and then cut
        to ERROR_TEXT: masked first, since `redact` knows a value only whole."""
        if m.error_message is not None:
            m.error_message = self._masked(m.error_message)
        self.context.sinks.record(m, self.key, self.headers)  # a traceparent: its span's parent

    # -- what the pipe hears (pipe.Ends) --------------------------------------------------

    def seen(self, from_client: bool, data: bytes, at: float) -> None:
        if self.open:
            self.watch.seen(from_client, data, at)
            return
        # Before the 101 only the upstream's bytes get here (the client's are held).
        if not self._answering and self._answered():
            # The final answer began: the idle timer judges the rest. Not at a 1xx, whose
            # stream (102 every few seconds) would keep a handshake past the first-byte
            # limit, which an HTTP request meets all the same.
            self._answering = True
            self._time_answer()
        after = self.answer.feed(data)
        if self.ended:  # a refusal's body ended in this read
            return
        head = self._head
        fault = head.fault if head is not None and head.fault is not None else self.answer.fault
        if fault is not None:
            self._malformed(fault)
        elif after is not None:
            self._opened(after, at)

    def _time_answer(self) -> None:
        """The idle timer on the upstream's final answer, which began: a 101 opens a tunnel,
        judged by --ws-idle-timeout; a refusal is an ordinary response (nginx tunnels only
        a 101, and reads any other answer under proxy_read_timeout), its body read under
        --idle-timeout as the HTTP relay reads a response body: one with no length, whose
        upstream sends some and then nothing, keeping its connection, would otherwise hold
        both connections for --ws-idle-timeout (300 s)."""
        head = self._head
        if head is None or head.released:
            self.pipe.start_idle(self.context.ws_idle_timeout, self._idle)
        else:
            self.pipe.start_idle(self.context.idle_timeout, self._stalled)

    def _stalled(self, quiet: float) -> None:
        """No byte of a refusal's body either way for --idle-timeout, its end not reached:
        cut as the HTTP relay cuts a response body (proxy/core/errors.py relay_failure,
        after the head): the upstream's silence is IDLE_TIMEOUT, a client whose write
        buffer stayed full took nothing (CLIENT_STALLED: its connection aborted, a close
        would wait on it). Both connections close; a body that runs to the close ends
        there. The session is still `refused`, and the refusal's record (`_refused`)
        carries the cut's error type and words, as the HTTP record of such a response."""
        client_stalled = self.pipe.holds_up(True)
        cause = Cause.CLIENT_STALLED if client_stalled else Cause.IDLE_TIMEOUT
        self._cut = cut = relay_failure(cause, after_headers=True, limit=self.context.idle_timeout)
        self._error = self._masked(cut.message)
        log.info("closing a refused WebSocket handshake: %s", cut.message)
        if cut.ending is Ending.ABORT:
            reset(self.pipe.client)  # as the HTTP relays cut a stalled client (backlog.py)
        self.end("refused")

    def _malformed(self, fault: str) -> None:
        """The upstream's answer is not HTTP llhttp takes: counted as the wire counts it
        on HTTP (tokenprobe_upstream_protocol_errors_total{kind="malformed"}), the client
        answered the HTTP relay's 502 in the same words while none of the final answer
        went (AnswerHead held a refused head back), and both connections end: nothing
        after such bytes can be followed, and the client's stay held."""
        self.context.sinks.count_upstream_protocol_error("malformed")
        error = UpstreamProtocolError("malformed", fault)
        failure = relay_failure(Cause.UPSTREAM_BROKE, after_headers=False, exc=error)
        self._answer_failure(failure)
        self._error = self._masked(failure.message)  # relayed or not: the record says why
        self.end("upstream_error")  # the HTTP relay's error type for the same bytes

    def lost(self, client_side: bool, exc: Exception | None) -> None:
        if self.ended:
            return
        if not self.open:
            if client_side:
                outcome = "client_vanished"
            elif self.answer.status >= 200:
                outcome = "refused"  # a refusal whose body ran to the connection's end
            else:
                outcome = "upstream_vanished"
                # Before any byte of its answer (a TLS backend refusing the proxy's
                # certificate, a crash): the client gets what an HTTP request gets.
                cause = exc or UpstreamClosed("the upstream closed the connection before answering")
                failure = relay_failure(Cause.UPSTREAM_BROKE, after_headers=False, exc=cause)
                self._answer_failure(failure)
        elif self.watch.first_close is not None:
            outcome = "closed_by_client" if self.watch.first_close else "closed_by_upstream"
        else:
            # A side that sent its FIN first (passed on: pipe.py `eof`) went first; the
            # other closing in answer did not vanish.
            gone = next(iter(self.pipe.ended), client_side)
            outcome = "client_vanished" if gone else "upstream_vanished"
        if self.watch.draining:
            outcome = "shutdown"
        self.end(outcome)

    def _refused(self, now: float) -> None:
        """The upstream refused the upgrade with an error: a record, as the HTTP relay
        makes of a refused request (its error type from the status and the body's words,
        proxy/core/errors.py), so that a realtime 401 counts among the auth errors; or,
        for one whose body was cut (`_stalled`), the cut's, as the HTTP relay records a
        response cut mid-body."""
        answer = self.answer
        body = bytes(answer.body)
        if self._cut is not None:  # its body cut short: the cut's error, as on HTTP
            error, message = self._cut.error, self._masked(self._cut.message)
        else:
            error = classify_response(answer.status, body) or ErrorType.UPSTREAM_ERROR
            message = self._masked(error_message(body)) if body else f"HTTP {answer.status}"
        try:
            self._session().refused(now, answer.status, error, message)
        except Exception:
            log.exception("recording a refused WebSocket upgrade failed")
            self.context.sinks.count_measurement_failure("finish")

    def _idle(self, quiet: float) -> None:
        log.info("closing a WebSocket tunnel idle for %.0f s", quiet)
        self.end("idle_timeout")

    # -- the end ------------------------------------------------------------------------

    def shutdown(self) -> None:
        """The drain: a close frame (1001) to each side at a frame boundary, then close."""
        if self.ended or self.watch.draining:
            return
        if not self.open:
            if not self._answered():
                self._answer_failure(relay_failure(Cause.SHUTDOWN, after_headers=False))
            self.end("shutdown")
            return
        self.watch.drain()
        self.pipe.later(self._drained)

    def _drained(self) -> None:
        if not self.ended:
            self.end("shutdown")

    def end(self, outcome: str) -> None:
        """Close both sides and hand the session to the sinks, once."""
        if self.ended:
            return
        self.ended = True
        self.outcome = outcome
        now = perf_counter()
        if self._connect is not None and not self._connect.done():
            self._connect.cancel()
        if self._unanswered is not None:
            self._unanswered.cancel()
        self.pipe.close()
        record = WsSessionRecord(
            route=self.route,
            outcome=outcome,
            started_at=self.started_at,
            duration=now - self.start,
            # what the client got: ours when we answered (after 1xx heads, perhaps), else
            # the upstream's status once any of its answer went
            status=self._status or (self.answer.status if self.pipe.relayed else 0),
            error=self._error,  # set with our answer, or for an answer llhttp refused
        )
        if outcome == "refused" and self.api is not None and self.answer.status >= 400:
            self._refused(now)
        self.context.sinks.session_ended(record)
        # Open until counted: whoever sees no tunnel open sees every ended one counted.
        self.context.tunnels.discard(self)
        self.watch.close(now, outcome)
        if not self.closed.done():
            self.closed.set_result(outcome)
