"""The ASGI relay: one request upstream through httpx and its response back, byte for byte.

The data path of `tokenprobe serve --relay asgi` and of the ASGI app (`proxy.asgi:app`)
under any ASGI server. `Forwarder` is the ASGI endpoint: it reads the request into its
`ExchangeRules` (proxy/server/rules.py, the same sans-I/O rules the wire carries out),
which refuse it or admit it, then a `Relay`, one per request, runs `send_request`
(upstream request, response head), `stream` (the per-chunk loop), `fail` (an early end ->
the proxy's answer) and the exchange's one finish sequence. What is measured and how
belongs to the shared exchange (proxy/server/exchange.py); what an early end means, to
the rules.

Each chunk goes to the client first; only then does the exchange see it, with the time of
the network read. A client that goes away (seen on `receive()`, because a send to a gone
client can succeed silently) cancels the upstream request at once, so the backend aborts
the generation and frees its KV cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from time import perf_counter, time
from typing import Any

import httpx
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE

from proxy.core.errors import Cause, Ending, Failure, LostTurn, fault_words
from proxy.core.paths import Target
from proxy.core.strip import UsageEventStripper
from proxy.core.tokens import TokenCounter
from proxy.server.admission import (
    BODY_TIMEOUT,
    ClientGone,
    Refused,
    RelaySettings,
    error_answer,
    relay_settings,
    stops_asking,
    where_to,
)
from proxy.server.backlog import reset
from proxy.server.exchange import Context, IdleTimer
from proxy.server.headers import client_address
from proxy.server.protocol import (
    ANSWER_CUT,
    ARRIVAL,
    BODY_WHOLE,
    CLIENT_TRANSPORT,
    HEAD_OVER_BOUND,
    MAX_RESPONSE_HEAD,
    header_line_bytes,
    refused_transfer_encoding,
)
from proxy.server.rules import ExchangeRules, UpstreamRequest
from proxy.server.upstream import body_reader, send_upstream
from proxy.server.upstream_errors import UpstreamProtocolError
from proxy.settings import Settings
from proxy.sinks.dispatch import Sinks
from proxy.types import Receive, Scope, Send

log = logging.getLogger("tokenprobe")


class UpstreamBroke(Exception):
    """Raised to the server after relaying a partial body, so it drops the client's
    connection instead of ending the body cleanly: the client sees the break, as it
    would have without the proxy."""


class Forwarder:
    """The ASGI relay's endpoint: shared by all requests, holding no request's state."""

    def __init__(
        self,
        *,
        client: httpx.AsyncClient,
        sinks: Sinks,
        counter: TokenCounter | None,
        settings: RelaySettings,
    ) -> None:
        self.client = client
        self.context = Context(sinks, counter, settings)
        settings.injection.on_refuse = sinks.usage_injection_refused
        settings.injection.on_forced = sinks.usage_comes_unasked
        settings.injection.on_leaked = functools.partial(stops_asking, sinks)

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        *,
        client: httpx.AsyncClient,
        sinks: Sinks,
        counter: TokenCounter | None,
    ) -> Forwarder:
        return cls(client=client, sinks=sinks, counter=counter, settings=relay_settings(settings))

    async def __call__(
        self, scope: Scope, receive: Receive, send: Send, where: Target | Refused | None = None
    ) -> None:
        """`where`: the request's target as the app normalised it to route it (ProxyApp
        decides on it whether the request is the proxy's own), so it is parsed once; None
        to parse it here."""
        rules = self._rules(scope, where)
        # A refusal before the body is read sends no 100 Continue (uvicorn sends it when the
        # body is first asked for), so a client that asked for one still waits for it.
        continue_owed = rules.refusal is not None and _expects_continue(scope)
        if rules.refusal is None:
            try:
                await _read_body(receive, rules, self.context.settings.body_timeout)
            except ClientGone:
                rules.abandoned()
                return
            except asyncio.CancelledError:
                # The server's drain time ran out while the body was still coming in (uvicorn
                # cancels the request's task): the 503 every request not yet answered gets.
                task = asyncio.current_task()
                assert task is not None
                task.uncancel()
                failure = rules.shut_out()
                assert failure.answer is not None
                await _send_answer(send, *failure.answer, rules.route, close=failure.closes)
                return
        if rules.refusal is not None:
            refusal = rules.refusal
            close = rules.refusal_closes(continue_owed, _body_whole(scope))
            await _send_answer(
                send, refusal.status, refusal.kind, refusal.message, rules.route, close=close
            )
            rules.refused()
            return
        # The request is in: the proxy's own time starts (overhead).
        upstream = rules.admit(perf_counter())
        url = self.context.upstream.origin + upstream.target
        await Relay(self.client, rules, scope, receive, send).run(url, upstream)

    def abandoned(self, scope: Scope, lost: LostTurn = LostTurn.CLIENT) -> None:
        """A request pipelined behind the running one, dropped before its turn: uvicorn
        never starts the app for it (protocol.py tells of it), and the wire records it,
        so this relay does too, timed from its arrival as there, nothing sent, by why its
        turn never came (`lost`), a request refused at its head too."""
        self._rules(scope).turn_lost(lost)

    def _rules(self, scope: Scope, where: Target | Refused | None = None) -> ExchangeRules:
        """The request's rules, timed from its arrival: when its head was in (stamped by
        the server's protocol, so a pipelined request's wait for its turn counts, as on the
        wire), else now (another ASGI server)."""
        raw_path = scope.get("raw_path") or scope["path"].encode()
        if where is None:
            where = where_to(raw_path, scope["query_string"])
        arrival = scope.get("extensions", {}).get(ARRIVAL)
        start, started_at = (perf_counter(), time()) if arrival is None else arrival
        return ExchangeRules(
            self.context,
            scope["method"],
            where,
            raw_path,
            scope["headers"],
            start,
            started_at,
            client_address(scope.get("client")),
        )


def _expects_continue(scope: Scope) -> bool:
    """The request asked for a 100 Continue, on HTTP/1.1 (an HTTP/1.0 request's
    expectation is ignored: protocol.py, as on the wire)."""
    return scope["http_version"] == "1.1" and any(
        name == b"expect" and value.lower() == b"100-continue" for name, value in scope["headers"]
    )


def _body_whole(scope: Scope) -> bool:
    """Whether the request's body was all in at its turn, unread: the server's protocol
    says (BODY_WHOLE); another ASGI server does not, and a refusal is answered as if the
    body were still owed (the connection closes: the safe answer)."""
    return scope.get("extensions", {}).get(BODY_WHOLE) is True


async def _read_body(receive: Receive, rules: ExchangeRules, timeout: float) -> None:
    """The whole request body into `rules`, which refuses one too large (413); one not in
    within `timeout` is refused 408; `ClientGone` if the client left."""
    try:
        async with asyncio.timeout(timeout):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone
                if rules.body(message.get("body", b"")) is not None:
                    return
                if not message.get("more_body", False):
                    return
    except TimeoutError:
        rules.refuse(BODY_TIMEOUT)


class Relay:
    """One request relayed upstream and its response back: `run` is the whole life.

    Three things may cancel the task running a relay: the client leaving
    (`_watch_client`), the idle timer, and the server when its drain time runs out. The
    first two cancel through `cut`, which records their cause, so a cancellation without
    one is the server's.
    """

    __slots__ = (
        "client",
        "cut",
        "exchange",
        "held",
        "idle",
        "receive",
        "response",
        "rules",
        "scope",
        "send",
    )

    def __init__(
        self,
        client: httpx.AsyncClient,
        rules: ExchangeRules,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        assert rules.exchange is not None, "admitted"
        self.client, self.rules, self.exchange = client, rules, rules.exchange
        self.scope, self.receive, self.send = scope, receive, send
        task = asyncio.current_task()
        assert task is not None
        self.cut = _CancelOnce(task)
        self.response: httpx.Response | None = None
        self.idle: IdleTimer | None = None
        self.held = b""  # what the client still gets after an early end (`fail`)

    async def run(self, url: str, upstream: UpstreamRequest) -> None:
        cut = self.cut
        watcher = asyncio.create_task(_watch_client(self.receive, cut))
        failure: Failure | None = None
        try:
            stripper = await self.send_request(url, upstream)
            await self.stream(stripper)
        except asyncio.CancelledError:
            cut.task.uncancel()
            failure = await self.fail(cut.cause or Cause.SHUTDOWN)
        except Exception as exc:
            failure = await self.fail(cut.cause or Cause.UPSTREAM_BROKE, exc)
        finally:
            cut.done = True
            watcher.cancel()
            if self.idle is not None:
                self.idle.cancel()
            if self.response is not None:
                await self.response.aclose()
        if self.held:  # the upstream is closed first, so the backend stops at once
            await self._hand_over(self.held)
        await self.exchange.finish(perf_counter(), failure)
        if failure is not None and failure.drop:
            transport = self.scope.get("extensions", {}).get(CLIENT_TRANSPORT)
            if failure.ending is Ending.ABORT and transport is not None:
                # a close would wait for good on what it never takes, and an abort leave
                # the kernel's queue to it (proxy/server/backlog.py)
                reset(transport)
            raise UpstreamBroke(failure.message)

    # -- the steps --------------------------------------------------------------------

    async def send_request(self, url: str, upstream: UpstreamRequest) -> UsageEventStripper | None:
        """Send the request upstream (to `url`: the upstream's origin and base path, then
        the normalised target) and the response head to the client. Returns the stripper
        if this response is one to strip."""
        exchange = self.exchange
        limits = exchange.context.settings
        exchange.sent(perf_counter())
        try:
            async with asyncio.timeout(limits.first_byte_timeout) as deadline:
                self.response = response = await send_upstream(
                    self.client, self.scope["method"], url, upstream.headers, upstream.body
                )
        except TimeoutError:
            if deadline.expired():
                self.cut.cause = Cause.FIRST_BYTE_TIMEOUT
            raise
        status = response.status_code
        if not 200 <= status <= 599:
            # a 101 the relay never asked for (both clients drop other 1xx), or three
            # digits that are no HTTP status (099, 600): a 502, as on the wire
            # (send_upstream refuses these itself for the proxy's own client, in these words)
            kind, said = (
                ("upgrade", fault_words("unasked_switch"))
                if 100 <= status < 200
                else ("malformed", fault_words("not_a_status", status=status))
            )
            exchange.context.sinks.count_upstream_protocol_error(kind)
            raise UpstreamProtocolError(kind, said)
        raw = [(k.lower(), v) for k, v in response.headers.raw]
        if (bad := _bad_head(raw)) is not None:
            exchange.context.sinks.count_upstream_protocol_error("malformed")
            raise UpstreamProtocolError("malformed", bad)
        head = self.rules.response_head(status, raw, perf_counter())
        # a 304's Content-Length goes as it came: the cycle frames it (protocol.FramedCycle)
        await self.send({"type": "http.response.start", "status": status, "headers": head.headers})
        exchange.relayed(perf_counter())
        return head.stripper

    async def stream(self, stripper: UsageEventStripper | None) -> None:
        """The per-chunk loop: each read goes to the client, then to the exchange. It
        runs for every chunk of every stream; add nothing here that could run once."""
        assert self.response is not None
        send, exchange = self.send, self.exchange
        strip = None if stripper is None else stripper.feed
        feed = exchange.feed
        read = body_reader(self.response)
        client = self.scope.get("extensions", {}).get(CLIENT_TRANSPORT)
        idle = self.idle = IdleTimer(exchange.context.settings.idle_timeout, self.cut, client)
        while True:
            idle.waiting = perf_counter()
            chunk = await read()
            now = idle.read = perf_counter()
            idle.waiting = None
            if not chunk:
                break
            out = chunk if strip is None else strip(chunk)
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
            feed(chunk, now)
        if stripper is not None and (rest := stripper.flush()):
            await send({"type": "http.response.body", "body": rest, "more_body": True})
        self.cut.done = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        exchange.end_of_stream(perf_counter())

    async def fail(self, cause: Cause, exc: BaseException | None = None) -> Failure:
        """The relay stopped early; a client that has no response head yet gets the
        proxy's own error answer."""
        self.cut.done = True
        failure = self.rules.early_end(cause, exc)
        if failure.answer is not None:  # Connection: close after the drain's 503
            close = failure.closes
            await _send_answer(self.send, *failure.answer, self.rules.route, close=close)
            return failure
        if failure.ending is Ending.CUT:  # for the requests pipelined behind
            self.scope.setdefault("extensions", {})[ANSWER_CUT] = True  # (protocol.py)
        idle = self.idle
        if idle is not None and idle.waiting is not None:
            # It stopped while waiting on the upstream, so every chunk read before went
            # out whole; stopped inside a send (the drain's end), that chunk never went,
            # and nothing may go after it.
            self.held = self.rules.held(failure)
        return failure

    async def _hand_over(self, held: bytes) -> None:
        """What the usage stripper held, to the client before its connection is dropped
        (ExchangeRules.held). The send waits on the client's flow control as any does,
        for no longer than a stalled client is given (--idle-timeout), as nothing cuts
        this relay any more; one that fails (the client left meanwhile) changes nothing,
        and the record is made all the same."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.exchange.context.settings.idle_timeout):
                await self.send({"type": "http.response.body", "body": held, "more_body": True})


class _CancelOnce:
    """Cancels a relay's task once, recording why. The client watcher and the idle timer
    hold this, not the relay, so a pending one never keeps the relay's buffers alive."""

    __slots__ = ("cause", "done", "task")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.cause: Cause | None = None  # None after a cancellation: the server's
        self.done = False  # the response is over: a client leaving now changes nothing

    def __call__(self, cause: Cause) -> None:
        if self.cause is None and not self.done:
            self.cause = cause
            self.task.cancel()


async def _watch_client(receive: Receive, cut: _CancelOnce) -> None:
    # A send to a gone client can succeed silently: only receive() tells.
    while (await receive())["type"] != "http.disconnect":
        pass
    cut(Cause.CLIENT_GONE)


def _bad_head(headers: list[tuple[bytes, bytes]]) -> str | None:
    """What is wrong with a response head the relay must refuse (a 502), if anything:

    - a header the server would refuse to write: a control character in a value, a
      separator or a control character in a name. The patterns are uvicorn's own
      (httptools_impl.py's HEADER_RE and HEADER_VALUE_RE, which its `send` checks), so
      the relay refuses exactly what uvicorn would, which it would do inside
      http.response.start, the response marked started by then (the client got an empty
      close, recorded as a 200); llhttp refuses the same on the wire;
    - a transfer coding other than chunked alone, whose body aiohttp hands on still
      coded (de-chunked, or read to the close), as llhttp does on the wire: the one rule
      of both (refused_transfer_encoding);
    - a head over the bound both data paths take (MAX_RESPONSE_HEAD), which neither
      client keeps to: aiohttp bounds a line, httpcore a head at 100 KiB."""
    codings = []  # every Transfer-Encoding line, judged together: two lines `chunked` too
    size = 0
    for name, value in headers:
        size += header_line_bytes(name, value)
        if HEADER_RE.search(name):
            return f"the upstream sent an invalid header name {name!r}"
        if HEADER_VALUE_RE.search(value):
            return f"the upstream sent an invalid header value in {name.decode('latin-1')!r}"
        if name == b"transfer-encoding":
            codings.append(value)
    if size > MAX_RESPONSE_HEAD:
        return HEAD_OVER_BOUND
    return refused_transfer_encoding(codings)


async def _send_answer(
    send: Send, status: int, kind: str, message: str, path: str, *, close: bool = False
) -> None:
    """The proxy's own answer; `close`: the connection closes after it (the server's
    drain is over: `connection: close`, which uvicorn honours, as the wire writes it)."""
    headers, body = error_answer(status, kind, message, path)
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


__all__ = ["Forwarder", "UpstreamBroke"]
