"""uvicorn's httptools protocol with limits on the request head, enforced as it arrives.

uvicorn hands the app a request only once its whole head is parsed, and httptools joins a
header value piece by piece until its line ends; an app-level size check therefore comes
after the memory and CPU are spent (a 64 MiB header value cost ~110 MiB and seconds of
stalled streams). And uvicorn times nothing before the first request's head: a
connection that sends nothing, or a byte a second, stays open until the file descriptors
run out. Here, per connection:

- the bytes of a request head are counted as they arrive, before the parser sees them:
  over the cap (--max-header-bytes and HEAD_SLACK) the client gets a 431 and the
  connection closes; a head within it whose header names and values are over
  --max-header-bytes gets the app's 431 on a connection that stays open (admission.py);
- the headers are counted too (431 over `max_headers`);
- a head must be complete within `header_timeout` seconds of the connection opening or,
  on a kept-alive connection, of the head's first byte: otherwise a 408 (or, when not a
  byte came, a plain close). An idle kept-alive connection is uvicorn's to close, after
  its keep-alive timeout (--keep-alive-timeout): a load balancer that pools connections
  to the proxy needs that longer than its own idle timeout, and a head timer running from
  the previous response's end would close them all at the header timeout instead.

And a request that asks to upgrade: llhttp parses nothing after it. Only a well-formed
WebSocket handshake (`proxy.server.tunnel.is_websocket_upgrade`, the one check) switches
protocols, and only once every response before it on the connection has ended (a
pipelined GET keeps its response); until then the connection is not read. Any other
upgrade request (a POST with `Upgrade: websocket`, a handshake with a body, h2c) is an
ordinary request, answered, and then the connection closes: what the client wrote after
it is never parsed, so never relayed. llhttp (through httptools) reads no body after an
upgrade request's head, so such a request's body is read by a second parser (`Upgrade`).
Trailer fields of a chunked body never join the request's headers (they are dropped, as
most proxies do), and are bounded as a head is: llhttp joins a trailer field's value across
reads as it does a header's, so an endless one would grow without bound at a quadratic
cost, stalling every connection on the loop. The fields as parsed count against the head's
cap (--max-header-bytes and HEAD_SLACK), and so do the reads of a body that bring none of
its data (llhttp tells no chunk's size: such reads are framing, a few bytes, or trailers).
Over it (or over `max_headers` fields), a 431 and a close, counted as an oversized head is;
a request whose answer is already going out gets no 431 inside it: the connection closes
after it, and the request never reaches the upstream (its body never ended).

A request's Host is checked as RFC 9112 §3.2 asks of a server, on both data paths and the
proxy's own routes: none in an HTTP/1.1 request, more than one, or a value that is no
`host[:port]` (`evil.example/steal?`) is a 400, and the connection closes, as llhttp's
own refusals are answered (nginx and h11 refuse the same). The proxy sends the upstream
its own Host, but the client's names the proxy in a redirect it rewrites (rules.py). So
is a Transfer-Encoding other than `chunked` alone (`gzip, chunked`), whose body would
otherwise go upstream de-chunked but still coded; the same rule (`only_chunked`) refuses
a response with any coding but `chunked` alone, on both data paths (`refused_codings`: a
502).

Requests pipelined behind the one running wait their turn, parsed: at most MAX_WAITING
on a connection, on both data paths. llhttp parses a whole read at once, and a pipelined
request parsed is an object waiting (the wire's WireRequest, uvicorn's cycle, a few
hundred bytes to a few KiB each) for a request head of some 30 bytes: pausing reading
stops the next read only, so a single read of tiny GETs behind a request the upstream
holds cost about a hundred times its size. At the bound the parser stops mid-read (a
callback's exception, as for the head limits) and the connection is parsed no more (what
follows is read and dropped, so that a client that leaves is seen): the requests waiting
are answered in order, the last answer says `Connection: close`, and the connection
closes after it, counted as `too_many_pipelined`. A client that pipelines must be ready
to send again what a closing connection left unanswered (RFC 9112 §9.3.2).

A request pipelined behind another whose turn never comes, the connection closing first,
is recorded as the connection closes, on both data paths, by why its turn never came
(`LostTurn`): the client's doing, the drain's end, or an answer before it that the proxy
cut for the upstream's failure and dropped with the connection.

Each close is counted in `tokenprobe_connections_closed_total{reason}`. The limits and
that counter are the served app's: uvicorn builds the protocol itself, in every worker,
and hands each one the state the app's lifespan filled in (`app_state`); ProxyApp puts a
`HeadGuard` there at startup (`HEAD_GUARD`), so two servers in one process keep their own
limits. Without one (an app that ran no lifespan) a connection gets the defaults.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter, time
from typing import TYPE_CHECKING, Any

import httptools
from prometheus_client import CollectorRegistry, Counter
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from proxy.core.errors import LostTurn, fault_words
from proxy.server.admission import answer_bytes
from proxy.server.headers import Headers
from proxy.server.tunnel import is_websocket_upgrade
from proxy.settings import Settings, group

if TYPE_CHECKING:
    from uvicorn._types import ASGISendEvent  # the type of uvicorn's own send

#: The most requests a connection may have waiting their turn (parsed, behind the one
#: running); past it the connection is parsed no further and closes after their answers
#: (see the module's docstring). Real clients rarely pipeline, and those that do (load
#: generators) a few deep; 16 keeps a connection's waiting requests to a few dozen KiB.
MAX_WAITING = 16

#: Room for the request line and the header block's framing on top of --max-header-bytes,
#: which the app checks as the sum of header names and values.
HEAD_SLACK = 8 * 1024


@dataclass(frozen=True)
class HeadLimits:
    """The request-head limits, made from the settings only (their defaults are theirs)."""

    max_head_bytes: int  # --max-header-bytes and HEAD_SLACK
    max_headers: int
    header_timeout: float | None
    body_timeout: float  # for the rest of a body answered early (on_response_complete)

    @classmethod
    def from_settings(cls, settings: Settings) -> HeadLimits:
        return group(cls, settings, max_head_bytes=settings.max_header_bytes + HEAD_SLACK)


#: The lifespan state key of the served app's HeadGuard (uvicorn's `app_state`).
HEAD_GUARD = "tokenprobe.head_guard"
#: The lifespan state key of the call that records a pipelined request dropped before its
#: turn, with the connection's `LostTurn` (the ASGI relay's Forwarder.abandoned; see
#: connection_lost).
ABANDONED = "tokenprobe.abandoned"
#: The scope extension the ASGI relay sets on a request whose answer it cut for the
#: upstream's failure (UPSTREAM_CUTS) and whose connection it dropped (see LostTurn).
ANSWER_CUT = "tokenprobe.answer_cut"
#: The scope extension holding when the request's head was in, `(perf_counter(), time())`:
#: a request is timed from there on both paths, a pipelined one's wait for its turn too.
ARRIVAL = "tokenprobe.arrival"
#: The scope extension holding the client's transport (see _start_asgi_task).
CLIENT_TRANSPORT = "tokenprobe.client_transport"
#: The scope extension saying whether the request's body was all in (llhttp's
#: on_message_complete came) when its turn came, stamped then (_start_asgi_task): what a
#: refusal at its head is answered by (rules.refusal_closes), as the wire's is at its turn
#: (WireRequest.begin, `complete`). An ASGI app is not told until it reads the body.
BODY_WHOLE = "tokenprobe.body_whole"


@dataclass(frozen=True)
class HeadGuard:
    """What a server's connections enforce on request heads, and where they count a close."""

    limits: HeadLimits
    on_close: Callable[[str], None]

    @classmethod
    def of(cls, settings: Settings, counter: Counter | None = None) -> HeadGuard:
        """The limits from `settings`; closes counted in `counter` (connection_counter)."""
        if counter is None:
            return cls(HeadLimits.from_settings(settings), _uncounted)
        children = {reason: counter.labels(reason) for reason in _REASONS}
        return cls(HeadLimits.from_settings(settings), lambda reason: children[reason].inc())


def _uncounted(reason: str) -> None:
    pass


class _HeadRefused(Exception):
    pass


class _BadHead(Exception):
    pass


class _TooManyWaiting(Exception):
    pass


#: A Host value (RFC 9112 §3.2, RFC 3986 §3.2.2): an IP literal in brackets, or an IPv4
#: address or registered name (unreserved, percent-encoded and sub-delims characters),
#: then an optional port. Empty is valid (a target with no authority).
_HOST = re.compile(
    rb"(?:\[[0-9A-Fa-f:.]+(?:%25[A-Za-z0-9._~-]+)?\]|[A-Za-z0-9._~!$&'()*+,;=%-]*)(?::[0-9]*)?"
)


#: The largest response head either data path takes, counted as its header lines are:
#: name and value, with ": " and the CRLF (`header_line_bytes`); nginx's proxy_buffer_size
#: is 4 or 8 KiB. Over it the response is malformed, a 502: the wire counts as it parses
#: (proxy/server/wire/upstream.py, which bounds a chunked body's trailers the same); the
#: ASGI relay once its client parsed the head (forward.py's `_bad_head`), which aiohttp
#: reads under the same bound a line (upstream_aiohttp.py) and httpcore under 100 KiB in
#: all (h11's max_incomplete_event_size, httpcore's MAX_INCOMPLETE_EVENT_SIZE, which it
#: takes no setting for).
MAX_RESPONSE_HEAD = 64 * 1024
HEAD_OVER_BOUND = "response head over 64 KiB"


def bodiless(status: int) -> bool:
    """Whether a final response with this status has no body, whatever its head says (RFC
    9112 §6.3, item 1): a 204 or a 304. Both data paths frame such a response by this one
    test, and relay a 304's Content-Length as it came: it is the selected representation's
    (RFC 9110 §8.6), no body's (a 204 may carry none: rules.py drops it)."""
    return status == 204 or status == 304


def header_line_bytes(name: bytes, value: bytes) -> int:
    """A header line's share of MAX_RESPONSE_HEAD."""
    return len(name) + len(value) + 4


def transfer_codings(value: bytes) -> list[bytes]:
    """A Transfer-Encoding value's codings, in order, lower case (RFC 9112 §6.1)."""
    return [coding.strip().lower() for coding in value.split(b",")]


def only_chunked(codings: list[bytes]) -> bool:
    """Whether a message's transfer codings (`transfer_codings`, over all its
    Transfer-Encoding lines) are none, or `chunked` alone: the only framing the proxy
    takes, from a client and from the upstream alike."""
    return not codings or codings == [b"chunked"]


def refused_codings(headers: Headers) -> str | None:
    """Why a response's transfer codings cannot be relayed, if they cannot: any but
    `chunked` alone (`refused_transfer_encoding`, over its Transfer-Encoding lines)."""
    return refused_transfer_encoding(
        [value for name, value in headers if name == b"transfer-encoding"]
    )


def refused_transfer_encoding(lines: list[bytes]) -> str | None:
    """Why a response with these Transfer-Encoding lines (its values, in order) cannot be
    relayed, if it cannot: any coding but `chunked` alone, judged over all lines together,
    as the request side judges them (`_head_wrong`): two lines `chunked` are `chunked,
    chunked`, refused alike. Under the chunks (`gzip, chunked`, a second `chunked`) both data
    paths de-chunk the body and frame it anew for the client, the coding beneath still
    on it; as the last coding (`gzip`, `chunked, gzip`) it frames nothing, so the body
    runs to the close (RFC 9112 §6.3, item 4), still coded. Either way the client would
    get the coded bytes unlabelled (transfer codings are hop by hop, and the proxy asked
    for none: it sends no TE), so such a response is malformed, a 502, as nginx refuses
    every coding but `chunked` ("upstream sent unknown Transfer-Encoding") and as the
    request side refuses the same (`_head_wrong`).

    Both data paths hand every response's lines here; nearly all are one line `chunked`
    or none, answered before any splitting."""
    if not lines or lines == _ONE_CHUNKED:
        return None
    codings = [coding for value in lines for coding in transfer_codings(value)]
    if only_chunked(codings):
        return None
    said = b", ".join(codings).decode("latin-1")
    return fault_words("transfer_coding", said=f" (transfer-encoding: {said})")


_ONE_CHUNKED = [b"chunked"]


def connection_counter(registry: CollectorRegistry) -> Counter:
    return Counter(
        "tokenprobe_connections_closed",
        "Client connections the proxy closed before a request reached the app, by reason: "
        "header_timeout (no complete request head within --header-timeout of the connection "
        "opening or, on a kept-alive connection, of the head's first byte; an idle kept-alive "
        "connection closed after --keep-alive-timeout is not counted), headers_too_large (head over "
        "--max-header-bytes plus 8 KiB for the request line and framing while it arrived; one "
        "within that is answered 431 on an open connection and counted as a request), "
        "too_many_headers (over --max-headers), "
        "tls_handshake (a TLS connection whose handshake had not ended within --header-timeout "
        "of its accept: closed then, if still in the handshake; one that failed sooner, a client "
        "certificate refused or a client gone, is counted at that same instant), malformed "
        "(bytes the HTTP parser refuses: answered 400, after the answers to the requests "
        "before them); and, after requests reached it, too_many_pipelined (a request "
        f"pipelined behind {MAX_WAITING} already waiting their turn: it and what follows are "
        "never parsed; those are answered, the last with Connection: close, then the "
        "connection closes).",
        ("reason",),
        registry=registry,
    )


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        guard = self.app_state.get(HEAD_GUARD)
        if not isinstance(guard, HeadGuard):  # no lifespan filled it in: the defaults
            guard = _DEFAULT_GUARD
        self.limits = guard.limits
        self.on_close = guard.on_close
        self._in_head = True
        self._head_bytes = 0
        self._head_tail = b""
        self._header_count = 0
        self._refusal: tuple[str, str] | None = None
        self._trailers = False  # _refusal is for a body's trailers (see _refuse_trailers)
        self._trailer_bytes = 0  # the fields of a chunked body's trailers, as parsed
        self._fed = False  # the read being parsed brought body data (on_body)
        self._dry_bytes = 0  # of a body's reads since the last that brought data
        self._head_timer: asyncio.TimerHandle | None = None
        self._ws = False  # the request whose head was parsed last is a WebSocket handshake
        # llhttp stopped before the stream's end: at an upgrade request, or at MAX_WAITING
        # (`Unparsed`); every later read goes here, never to the parser
        self._diverted: Upgrade | Unparsed | None = None
        self._body_due: bytes | None = None  # that request's framing headers: see Upgrade
        # The request whose response is under way. uvicorn's `cycle` is the request parsed
        # last, which with pipelining is one still waiting: the running one must hear of
        # a client gone (its upstream request cancelled) and of the client's flow control.
        self.running: Any = None
        self._body_open = False  # a request's head is in and its body not yet all
        self._bad_request: str | None = None  # a 400 owed once the answers before it are out
        self._bad_head: str | None = None  # why the head just parsed is refused (Host, TE)
        # set while the rest of a body answered early is read and dropped (its
        # --body-timeout): the next head starts when that body ends (on_response_complete)
        self._rest_timer: asyncio.TimerHandle | None = None
        # Over TLS this protocol is made at the accept and connected after the handshake,
        # which the loop bounds by the header timeout (proxy.server.eventloop); a handshake
        # not over by then is counted here, as nothing tells this protocol it ended.
        self._handshake_timer: asyncio.TimerHandle | None = None
        self.draining = False  # the server's drain began (uvicorn called `shutdown`)
        self.answer_cut = False  # an answer was cut for the upstream's failure (LostTurn.CUT)
        self.peer_left = False  # the client sent its end of input
        timeout = self.limits.header_timeout
        if self.config.is_ssl and timeout is not None:
            self._handshake_timer = self.loop.call_later(timeout, self.on_close, "tls_handshake")

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
            self._handshake_timer = None
        super().connection_made(transport)
        self._start_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        self._stop_rest_timer()
        running, self.running = self.running, None  # it refers back to this protocol
        if (
            isinstance(running, RequestResponseCycle)
            and running is not self.cycle  # uvicorn tells only that one
            and not running.response_complete
        ):
            running.disconnected = True
            running.message_event.set()
        abandoned = self.app_state.get(ABANDONED)
        if abandoned is not None and self.pipeline:  # waited their turn: never started
            if isinstance(running, RequestResponseCycle) and running.scope.get(
                "extensions", {}
            ).get(ANSWER_CUT):
                self.answer_cut = True
            lost = self.lost_turn(exc)
            for cycle, _ in self.pipeline:
                if isinstance(cycle, RequestResponseCycle) and cycle is not running:
                    abandoned(cycle.scope, lost)
        super().connection_lost(exc)

    def lost_turn(self, exc: Exception | None) -> LostTurn:
        """Why the requests still waiting their turn as the connection closed never got it.
        The proxy closed it when the client neither ended nor reset it: at the drain's end,
        or as it dropped an answer the upstream cut (`answer_cut`); then they are not the
        client's cancellations. Any other close is the client's (it left, asked for the
        close, or stopped reading the answer before them)."""
        if exc is not None or self.peer_left:
            return LostTurn.CLIENT
        if self.draining:
            return LostTurn.DRAIN
        return LostTurn.CUT if self.answer_cut else LostTurn.CLIENT

    def eof_received(self) -> None:  # None: the transport closes (the client is gone)
        self.peer_left = True
        super().eof_received()

    def shutdown(self) -> None:
        self.draining = True
        super().shutdown()

    def _start_head(self, *, timed: bool = True) -> None:
        """Ready for a request head; `timed`: its time runs from now (a new connection),
        else from its first byte (a kept-alive connection, idle until then)."""
        self._in_head = True
        self._head_bytes = 0
        self._head_tail = b""
        self._header_count = 0
        self._stop_head_timer()
        if timed:
            self._time_head()

    def _time_head(self) -> None:
        timeout = self.limits.header_timeout
        if timeout is not None:
            self._head_timer = self.loop.call_later(timeout, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def data_received(self, data: bytes) -> None:
        diverted = self._diverted
        if diverted is not None:  # nothing after an upgrade request (or the stop) is parsed
            diverted.more(data)
            return
        in_body = False
        if self._in_head:
            if self._head_timer is None:  # a kept-alive connection's next head begins
                self._time_head()
            if not self._count_head(data):
                return
        elif self._body_open:
            in_body, self._fed = True, False
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self._diverted is _UNPARSED:  # stopped by us at MAX_WAITING: no 400 owed
                return
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
            return
        except httptools.HttpParserUpgrade as exc:
            self._upgrade_at(data[exc.args[0] :])
            return
        if in_body and not self._fed and self._body_open:
            self._count_dry(len(data))

    def _count_dry(self, size: int) -> None:
        """A read of a body that brought none of its data (framing, or the trailers after
        the last chunk): the reads since the last data are bounded as a head is."""
        self._dry_bytes += size
        if self._dry_bytes > self.limits.max_head_bytes:
            size = self.limits.max_head_bytes - HEAD_SLACK
            self._refuse_trailers("headers_too_large", f"request trailers over {size} bytes")

    def on_body(self, body: bytes) -> None:
        self._fed, self._dry_bytes = True, 0
        super().on_body(body)

    def _upgrade_at(self, rest: bytes) -> None:
        """llhttp stopped after a request that asked to upgrade; `rest` came after it."""
        if not self._ws:  # an ordinary request: answered, then the connection closes
            if self.cycle is not None:
                self.cycle.keep_alive = False
            upgrade = self._diverted = Upgrade(self, b"", tunnel=False, framing=self._body_due)
            upgrade.more(rest)
            return
        upgrade = self._diverted = Upgrade(self, rest, tunnel=True)
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            upgrade.begin()
        else:  # a response before it is under way: the switch waits its turn, unread
            self.flow.pause_reading()
            self.pipeline.appendleft((upgrade, self.app))  # type: ignore[arg-type]

    def _switch(self, rest: bytes) -> None:
        """Switch protocols now (uvicorn's WebSocket protocol; the wire's tunnel)."""
        self.handle_websocket_upgrade()

    def _should_upgrade(self) -> bool:
        return self._ws

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        self.running = cycle
        if isinstance(cycle, Upgrade):
            cycle.begin()
        else:
            # For a client that holds its response up (proxy/server/forward.py): whether it
            # still takes bytes, and an abort when it stopped (uvicorn's close would wait
            # for good on a write buffer it never takes).
            extensions = cycle.scope.setdefault("extensions", {})
            extensions[CLIENT_TRANSPORT] = self.transport
            # uvicorn clears `more_body` at the message's end: a request pipelined
            # behind another may have all of its body in when its turn comes
            extensions[BODY_WHOLE] = not cycle.more_body
            if type(cycle) is RequestResponseCycle:
                # uvicorn makes every cycle itself (on_headers_complete), of its own class;
                # only its send changes, before the app has run a line (see FramedCycle)
                older = cycle.scope["http_version"] != "1.1"
                cycle.__class__ = UnframedCycle if older else FramedCycle
            super()._start_asgi_task(cycle, app)

    def _count_head(self, data: bytes) -> bool:
        """Count a read of a request head; False when it went over the cap (refused).

        One read can carry the end of the head and the start of a large body (a client
        writes both at once; loopback reads are up to 256 KiB): only when no blank line
        ends the head within the cap is the head too large."""
        room = self.limits.max_head_bytes - self._head_bytes
        self._head_bytes += len(data)
        if room >= len(data):
            self._head_tail = data[-3:]  # a blank line can straddle two reads
            return True
        window = self._head_tail + data[: max(room, 0)]
        if b"\r\n\r\n" in window or b"\n\n" in window:
            return True
        size = self.limits.max_head_bytes - HEAD_SLACK
        self._refuse("headers_too_large", f"request headers over {size} bytes")
        return False

    def on_message_begin(self) -> None:
        if len(self.pipeline) >= MAX_WAITING:  # every request before this one is complete
            self._stop_parsing()
            raise _TooManyWaiting  # llhttp stops here, mid-read: the rest is never parsed
        self._ws = False
        self._body_due = None
        if not self._in_head:  # a pipelined request: its head is counted from here on
            self._in_head, self._head_bytes, self._header_count = True, 0, 0
            self._head_tail = b""
        super().on_message_begin()

    def _stop_parsing(self) -> None:
        """MAX_WAITING requests wait their turn and another begins: the connection is
        parsed no further. Those waiting are answered in order (each begins as the one
        before ends), the last with `Connection: close`, and the connection closes after
        it. Reading goes on, each read dropped unparsed (`Unparsed`): a client that
        leaves is seen at once, and the running request's upstream request cancelled;
        paused, its close would wait unseen (CLOSE-WAIT) until that request ended."""
        self.on_close("too_many_pipelined")
        self._diverted = _UNPARSED
        last, _ = self.pipeline[0]  # the one parsed last (uvicorn's queue is appended left)
        last.keep_alive = False
        self._stop_head_timer()
        self._in_head = False
        self.flow.resume_reading()  # (the wire and uvicorn paused it for those waiting)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.max_headers:
            self._refusal = ("too_many_headers", f"over {self.limits.max_headers} request headers")
            self._trailers = not self._in_head
            raise _HeadRefused
        if not self._in_head:  # a trailer field: dropped, and bounded as the head is
            self._trailer_bytes += len(name) + len(value) + 4
            if self._trailer_bytes > self.limits.max_head_bytes:
                size = self.limits.max_head_bytes - HEAD_SLACK
                self._refusal = ("headers_too_large", f"request trailers over {size} bytes")
                self._trailers = True
                raise _HeadRefused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_done()
        self._ws = self._is_handshake() and self._should_upgrade_to_ws()
        self._body_due = self._upgrade_body()
        extensions: dict[str, Any] = {ARRIVAL: (perf_counter(), time())}
        self.scope["extensions"] = extensions
        super().on_headers_complete()
        self.headers = []  # a chunked body's trailers, if any, land here, not in the scope

    def on_message_complete(self) -> None:
        if self._body_due is None:  # else llhttp skipped the body: Upgrade reads it
            super().on_message_complete()
            self._body_done()

    def _upgrade_body(self) -> bytes | None:
        """For an upgrade request that will not switch and has a body, its framing
        headers; else None."""
        if self._ws or not self.parser.should_upgrade():
            return None
        framing = [
            b"%s: %s\r\n" % (name, value)
            for name, value in self.headers
            if name in (b"content-length", b"transfer-encoding")
        ]
        return b"".join(framing) or None

    def _is_handshake(self) -> bool:
        parser = self.parser
        if not parser.should_upgrade():
            return False
        http_11 = parser.get_http_version() == "1.1"
        return is_websocket_upgrade(parser.get_method(), self.headers, http_11=http_11)

    def _head_done(self) -> None:
        """The request's head is parsed (both paths call this first at its end)."""
        self._in_head = False
        self._body_open = True
        self._fed = True  # the read that ended a head is no body read without data
        self._stop_head_timer()
        if (wrong := self._head_wrong()) is not None:  # answered as llhttp's refusals are
            self._bad_head = wrong
            raise _BadHead
        url = self.url
        if url[:1] != b"/" and (start := url.find(b"://") + 3) > 2:
            self._absolute_form(url, start)
        if self.expect_100_continue and self.parser.get_http_version() != "1.1":
            # An HTTP/1.0 request's expectation is ignored, and no 1xx goes to an HTTP/1.0
            # client (RFC 9110 §10.1.1, §15.2; nginx and h11 alike): uvicorn's would write
            # one on both paths, as it reads the header whatever the version.
            self.expect_100_continue = False

    def _absolute_form(self, url: bytes, start: int) -> None:
        """An absolute-form target (`http://host/path`, RFC 9112 §3.2.2; `start` where its
        authority starts): its host, not the Host header, is the one the client named,
        and an empty path is "/" (RFC 9110 §4.2.3: `http://host?q` is `http://host/?q`;
        httptools' parse gives no path for it, and both paths read the path from it)."""
        end = len(url)
        for mark in (b"/", b"?"):
            if 0 <= (at := url.find(mark, start)) < end:
                end = at
        if url[end : end + 1] != b"/":
            self.url = url[:end] + b"/" + url[end:]
        host = url[start:end].rpartition(b"@")[2]  # no userinfo
        # in place: uvicorn's scope holds this very list
        self.headers[:] = [(name, host if name == b"host" else v) for name, v in self.headers]

    def _head_wrong(self) -> str | None:
        hosts = []
        codings: list[bytes] = []
        for name, value in self.headers:
            if name == b"host":
                hosts.append(value)
            elif name == b"transfer-encoding":
                codings.extend(transfer_codings(value))
        if not only_chunked(codings):
            # llhttp refuses a last coding other than chunked, and decodes `gzip, chunked`
            # to its chunks: the body would go upstream still gzip-coded, and unlabelled.
            # (RFC 9112 §6.1 asks a 501; nginx and h11 answer one; a 400 refuses it too.)
            return "Invalid HTTP request received: no transfer coding but chunked is taken."
        if len(hosts) > 1:
            return "Invalid HTTP request received: more than one Host header."
        if not hosts:
            if self.parser.get_http_version() == "1.1":
                return "Invalid HTTP request received: an HTTP/1.1 request needs a Host header."
            return None
        if _HOST.fullmatch(hosts[0]) is None:
            return "Invalid HTTP request received: the Host header is no host[:port]."
        return None

    def _body_done(self) -> None:
        """The request's message ended (on_message_complete, on both data paths)."""
        self._body_open = False
        self._trailer_bytes = self._dry_bytes = 0
        if self._rest_timer is not None:
            self._stop_rest_timer()
            self._start_head(timed=False)
            # idle from here, as uvicorn's on_response_complete makes a connection (the
            # body's bytes unset the keep-alive timer it armed there)
            self._unset_keepalive_if_required()
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    def _rest_overdue(self) -> None:
        """The rest of a body answered early did not come within --body-timeout of the
        answer: the connection closes (its one answer is out; a second would not be
        one the client could tell from the next request's)."""
        self._rest_timer = None
        self.transport.close()

    def _stop_rest_timer(self) -> None:
        if self._rest_timer is not None:
            self._rest_timer.cancel()
            self._rest_timer = None

    def on_response_complete(self) -> None:
        waiting = bool(self.pipeline)  # the next request's head is already in
        super().on_response_complete()
        if waiting or self.transport.is_closing():
            return
        if self._bad_request is not None:  # every answer before it is out: now the 400
            super().send_400_response(self._bad_request)
            return
        if self._body_open:
            # Answered before its body was all in (a 413, a refusal at the head): what
            # comes next is that body, read and dropped, not a head to count and time; it
            # gets --body-timeout, as a body does, whatever keeps the connection busy.
            self._rest_timer = self.loop.call_later(self.limits.body_timeout, self._rest_overdue)
        else:
            self._start_head(timed=False)  # idle until it begins: uvicorn's keep-alive timer

    def send_400_response(self, msg: str) -> None:
        if self._refusal is not None:  # the parser stopped at our callback's exception
            reason, message = self._refusal
            if self._trailers:
                self._refuse_trailers(reason, message)
            else:
                self._refuse(reason, message)
            return
        if self._bad_head is not None:  # the same, for the Host or the TE: malformed
            msg, self._bad_head = self._bad_head, None
        self.on_close("malformed")
        cycle = self.cycle
        waiting = next((entry for entry in self.pipeline if entry[0] is cycle), None)
        if cycle is not None and not cycle.response_complete and (waiting or not self._body_open):
            # Bytes the parser refuses behind a request whose answer is still to go out
            # (pipelined garbage, or a waiting request's malformed body): a 400 now would
            # land inside that answer. The answers before it go out whole, then the 400,
            # then the close: responses in the order of the requests (RFC 9112 §9.3.2).
            if waiting is not None and self._body_open:  # the malformed request itself
                self.pipeline.remove(waiting)
            self._bad_request = msg
            self._stop_head_timer()  # the bad head's: its 408 would land there too
            self._in_head = False
            self.flow.pause_reading()
            return
        super().send_400_response(msg)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport.is_closing():
            return
        self.on_close("header_timeout")
        if self._head_bytes:
            timeout = self.limits.header_timeout
            self._write_error(
                408, "request_timeout", f"request headers not received in {timeout:g} s"
            )
        self.transport.close()

    def _refuse(self, reason: str, message: str) -> None:
        self.on_close(reason)
        self._stop_head_timer()
        if self.cycle is not None and not self.cycle.response_complete:
            # A response is under way on this connection: let it end, then close.
            self.cycle.keep_alive = False
            self.flow.pause_reading()
            return
        self._write_error(431, "request_header_fields_too_large", message)
        self.transport.close()

    def _refuse_trailers(self, reason: str, message: str) -> None:
        """A request's trailers went over the head's limits: its body never ends, so it
        never goes upstream. A 431 and a close, unless an answer is going out already."""
        self.on_close(reason)
        self._body_open = False  # nothing more of it is read
        self.flow.pause_reading()
        cycle = self.cycle
        running = self.running
        if cycle is None or cycle.response_complete:  # answered early: its answer is out
            self.transport.close()
            return
        if running is cycle and not getattr(cycle, "response_started", False):
            # (the wire's request has no response_started: it answers whole, complete)
            self._write_error(431, "request_header_fields_too_large", message)
            self.transport.close()
            return
        # An answer is going out (this request's, or the one before it, which this request
        # waits behind): it ends, then the connection closes; this request never runs.
        waiting = next((entry for entry in self.pipeline if entry[0] is cycle), None)
        if waiting is not None:
            self.pipeline.remove(waiting)
        if running is not None:
            running.keep_alive = False
        cycle.keep_alive = False

    def _write_error(self, status: int, kind: str, message: str) -> None:
        self.transport.write(answer_bytes(status, kind, message, None, close=True))


#: What uvicorn is told an unframed body still holds until its last piece (UnframedCycle):
#: more than any body will.
_UNBOUNDED = 1 << 62


class FramedCycle(RequestResponseCycle):
    """uvicorn's cycle, framing a bodiless response (`bodiless`) by its status, as the wire
    and every HTTP/1.1 peer do. uvicorn's send takes a 304's Content-Length (the
    representation's, RFC 9110 §8.6) as the length of a body to come, then refuses the
    empty one that ends the response and drops the connection, losing the request after
    it; so it is told, once the head is out, that no body is owed, as it tells itself for
    a HEAD. A body the app sends anyway goes nowhere, as a HEAD's does."""

    no_body = False  # the response under way has none, whatever its head says

    async def send(self, message: ASGISendEvent) -> None:
        if not self.response_started:
            await super().send(message)
            if message["type"] == "http.response.start" and bodiless(message["status"]):
                self.no_body, self.expected_content_length = True, 0
        elif self.no_body and message["type"] == "http.response.body":
            more = message.get("more_body", False)
            await super().send({"type": "http.response.body", "body": b"", "more_body": more})
        else:
            await super().send(message)


class UnframedCycle(FramedCycle):
    """The cycle of a request older than HTTP/1.1 (an HTTP/1.0 client): a response of no
    known length goes unframed, and the connection's close ends it (RFC 9112 §6.3, item
    8), as the wire, nginx and h11 send it. uvicorn's send frames any response with no
    Content-Length in chunks, whatever the request's version, and an HTTP/1.0 client
    cannot read chunks: it would take the sizes for body bytes (RFC 9112 §6.1: a server
    MUST NOT send Transfer-Encoding in answer to an HTTP/1.0 request). uvicorn's send
    still writes the head and the body: it is told the body has a length it will not
    reach, then, with the last piece, that the piece is what is left. Such a request is
    never kept alive (uvicorn's keep_alive is False for HTTP/1.0), so the close comes."""

    unframed = False  # the response under way goes without framing

    async def send(self, message: ASGISendEvent) -> None:
        if self.response_started:
            body = message if message["type"] == "http.response.body" else None
            if self.unframed and body is not None and not body.get("more_body", False):
                # the last piece: what is left is this piece, and uvicorn's count ends
                self.expected_content_length = len(body.get("body", b""))
        elif message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            lengths = any(name.lower() == b"content-length" for name, _ in headers)
            if not (
                lengths
                or self.scope["method"] == "HEAD"
                or bodiless(message["status"])  # no body, no framing
            ):
                self.unframed, self.keep_alive = True, False
                self.chunked_encoding = False  # uvicorn adds no framing of its own
                self.expected_content_length = _UNBOUNDED
                framed = [(n, v) for n, v in headers if n.lower() != b"transfer-encoding"]
                message = {**message, "headers": framed}  # no framing said either
        await super().send(message)


class Upgrade:
    """A request llhttp stopped at because it asked to upgrade. A WebSocket handshake
    (`tunnel`) waits in uvicorn's pipeline, as a request would, for the responses before
    it; what the client sends meanwhile is kept for the tunnel, one read at a time.

    Any other is an ordinary request whose body llhttp did not read (httptools tells it
    to skip the body of an upgrade request, and it reports the message complete at once):
    a second parser, fed a head made of the request's own framing headers, reads the body
    for it, and only then is the message complete. What follows the body is dropped: the
    connection closes after the answer."""

    __slots__ = ("body", "done", "proto", "rest", "tunnel")

    def __init__(
        self,
        proto: GuardedHttpToolsProtocol,
        rest: bytes,
        *,
        tunnel: bool,
        framing: bytes | None = None,
    ) -> None:
        self.proto, self.rest, self.tunnel = proto, rest, tunnel
        self.done = framing is None
        self.body: httptools.HttpRequestParser | None = None
        if framing is not None:
            self.body = httptools.HttpRequestParser(self)
            self.more(b"POST / HTTP/1.1\r\n" + framing + b"\r\n")

    def more(self, data: bytes) -> None:
        if self.tunnel:
            self.rest += data
            self.proto.flow.pause_reading()
        elif not self.done and self.body is not None:
            try:
                self.body.feed_data(data)
            except httptools.HttpParserError:
                if not self.done:  # a malformed body: as the first parser answers one
                    self.done = True
                    self.proto.send_400_response("Invalid HTTP request received.")

    def on_body(self, body: bytes) -> None:
        if not self.done:
            self.proto.on_body(body)

    def on_message_complete(self) -> None:
        if not self.done:
            self.done = True
            self.proto._body_due = None
            self.proto.on_message_complete()

    def begin(self) -> None:
        rest, self.rest = self.rest, b""
        self.proto._switch(rest)


class Unparsed:
    """What a connection sends after the proxy stopped parsing it (MAX_WAITING): read, so
    that the client's close is seen, and dropped unparsed."""

    __slots__ = ()

    def more(self, data: bytes) -> None:
        pass


_UNPARSED = Unparsed()

_REASONS = (
    "header_timeout",
    "headers_too_large",
    "too_many_headers",
    "tls_handshake",
    "malformed",
    "too_many_pipelined",
)

#: For a connection whose app filled in no HeadGuard: the settings' default limits (the
#: upstream is a placeholder; head limits do not depend on it), closes not counted.
_DEFAULT_GUARD = HeadGuard.of(Settings(upstream="http://upstream.invalid"))
