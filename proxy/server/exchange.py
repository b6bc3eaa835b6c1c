"""The measured exchange, one per request, driven alike by both data paths.

It owns what a request's measuring needs from admission to its one record: the observer,
the sinks' `begin` and `end` (in-flight gauge, per-key labels, trace span and the
`traceparent` that goes upstream, cost), the one place observer failures stop (`feed`,
`end_of_stream`: the stream goes on unmeasured and a counter says so), what an early end
means (`failure`, decided by proxy.core.errors.relay_failure) and the one finish sequence
(`finish`). A data path only moves bytes: it calls `open` at the response head, `feed`
after each chunk went to the client (with the time of the network read), and `finish`
once. `IdleTimer` times the gaps of an upstream body on the ASGI relay (the wire folds the
same check into its request's one timer, proxy/server/wire/connection.py `_check`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from time import perf_counter
from typing import Any

from proxy.core.background import Table, late_tokens, left_unfinished, settled
from proxy.core.errors import Cause, Failure, relay_failure
from proxy.core.identity import Backend
from proxy.core.labels import route_template
from proxy.core.measurement import ErrorType, Measurement
from proxy.core.observe import StreamObserver, bare_record
from proxy.core.request import RequestInfo
from proxy.core.secrets import redact
from proxy.core.sse import EventTooLarge
from proxy.core.tokens import TokenCounter
from proxy.core.upstream_url import UpstreamURL
from proxy.server.admission import RelaySettings
from proxy.server.backlog import Progress
from proxy.server.deadline import Deadline
from proxy.server.headers import Headers, upstream_headers
from proxy.sinks.dispatch import RequestScope, Sinks
from proxy.sinks.keys import checks_keys
from proxy.sinks.sink import Labels

log = logging.getLogger("tokenprobe")


@dataclass(frozen=True, slots=True)
class Context:
    """What every exchange of a server shares."""

    sinks: Sinks
    counter: TokenCounter | None
    settings: RelaySettings
    #: What the upstream last said it is (proxy/server/identity.py updates it in place).
    backend: Backend = field(default_factory=Backend)
    #: The one parse of --upstream every data path sends to (base path kept).
    upstream: UpstreamURL = field(init=False)
    #: This process's background Responses whose tokens a retrieval is to count
    #: (proxy/core/background.py): one table per worker, shared by both data paths.
    background: Table[Labels] = field(default_factory=Table)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "upstream", UpstreamURL.parse(self.settings.upstream, self.settings.upstream_uds)
        )


class MeasuredExchange:
    """One request's measuring state; `info` None for a request that is only relayed."""

    __slots__ = (
        "client",
        "context",
        "headers",
        "info",
        "measuring",
        "observer",
        "path",
        "query",
        "read",
        "request_scope",
        "retrieves",
        "start",
        "started_at",
        "status",
        "withheld",
    )

    def __init__(
        self,
        context: Context,
        path: str,
        headers: Headers,
        info: RequestInfo | None,
        start: float,
        started_at: float,
        read: float | None = None,
        query: str = "",
        client: str | None = None,
        retrieves: str | None = None,
    ) -> None:
        """`retrieves`: the id of a background Response whose tokens no answer counted
        yet, when this is its retrieval (proxy/core/background.py `retrieval`)."""
        self.context, self.path, self.headers = context, path, headers
        self.retrieves = retrieves
        self.client = client  # its address, for X-Forwarded-For
        self.query = query  # only for redacting credentials it carries from error text
        self.info, self.start, self.started_at = info, start, started_at
        self.read = start if read is None else read  # when the request was all in
        self.status = 0  # what the client got; 0 until a response head went out
        # The client left while the proxy held back part of the body the observer read
        # (ExchangeRules.early_end): the observer cannot say that the client's answer was
        # whole (`finish`).
        self.withheld = False
        self.observer = (
            None
            if info is None
            else StreamObserver(
                info,
                start,
                collect_text=context.counter is not None,
                max_event_bytes=context.settings.max_event_bytes,
            )
        )
        self.measuring = self.observer is not None
        # a retrieval is read, never recorded: no in-flight request, span or turn
        self.request_scope: RequestScope = context.sinks.begin(
            None if retrieves is not None else info,
            headers,
            started_at,
            checks_keys(context.backend.kind, path),
        )

    def upstream_headers(self) -> Headers:
        return upstream_headers(
            self.headers,
            measured=self.info is not None,
            trace=self.request_scope.upstream_headers,
            client=self.client,
        )

    def sent(self, now: float) -> None:
        """The request goes to the upstream now: the proxy's own time since `read`."""
        if self.observer is not None:
            self.observer.sent(self.read, now)

    def relayed(self, now: float) -> None:
        """The response head went out to the client now (the proxy's own time again)."""
        if self.observer is not None:
            self.observer.relayed(now)

    def open(
        self, status: int, content_type: str, now: float, metadata: bytes | None = None
    ) -> None:
        """The upstream's response head arrived (and goes to the client now); `metadata`
        is its `metadata` header's value, where a binary answer keeps its usage."""
        self.status = status
        if self.observer is not None:
            self.observer.open(status, content_type, now, metadata)

    def feed(self, chunk: bytes, now: float) -> None:
        """A chunk that just went to the client, read from the network at `now`."""
        if self.measuring:
            try:
                self.observer.feed(chunk, now)  # type: ignore[union-attr]
            except EventTooLarge:  # relayed all the same, unmeasured from here on
                self.observer_failed("event_too_large")
            except Exception:
                self.observer_failed("observe")

    def end_of_stream(self, now: float) -> None:
        if self.measuring:
            try:
                self.observer.end_of_stream(now)  # type: ignore[union-attr]
            except Exception:
                self.observer_failed("observe")

    def observer_failed(self, stage: str) -> None:
        """The one place observer failures stop: the stream goes on, the record is kept
        to what is safe, and a counter says so."""
        if stage == "observe":
            log.exception("observer failed; the stream goes on unmeasured")
        else:
            log.warning("stream no longer measured (%s); it goes on unchanged", stage)
        self.measuring = False
        self.context.sinks.count_measurement_failure(stage)
        if self.observer is not None:
            self.observer.fail()

    def failure(self, cause: Cause, exc: BaseException | None = None) -> Failure:
        """What an early end means: the record's error, and the client's answer if no
        response head went out yet (else whether to drop the connection)."""
        settings = self.context.settings
        idle = cause is Cause.IDLE_TIMEOUT or cause is Cause.CLIENT_STALLED
        limit = settings.idle_timeout if idle else settings.first_byte_timeout
        failure = relay_failure(cause, after_headers=self.status != 0, exc=exc, limit=limit)
        if failure.answer is None:
            return failure
        # The client's answer says what broke in the upstream client's words, which may
        # quote the bytes the upstream sent back: an echo of this request's credentials
        # (`BadStatusLine: b'... Bearer sk-...'`). Masked as the record's message is.
        status, kind, told = failure.answer
        return replace(failure, answer=(status, kind, self.redact(told)))

    async def finish(self, end: float, failure: Failure | None) -> None:
        """The one finish sequence: a measured request's record goes to the sinks (from
        the observer, or bare if measuring it broke); any other is counted by route."""
        sinks, observer, request_scope = self.context.sinks, self.observer, self.request_scope
        if observer is None:
            sinks.passthrough(route_template(self.path), self.status)
            return
        if (
            failure is not None
            and failure.error is ErrorType.CLIENT_CANCELLED
            and not failure.drop
            and not self.withheld
        ):
            # A client that left once the stream was whole (the OpenAI SDK closes at
            # [DONE], before the terminator) got its answer: ended where it was whole. The
            # observer reads the upstream's bytes, so only where the client was given all
            # of them: not where the usage stripper still held the finish chunk.
            answered = observer.answered_at()
            if answered is not None:
                failure, end = None, answered
        error = None if failure is None else failure.error
        message = None if failure is None else failure.message
        # a count the tokenizer fails is told as stage "tokenizer"; the record stays whole;
        # a retrieval counts its response's usage or nothing
        counter = None if self.retrieves is not None else self.context.counter
        counting = None if counter is None else counter.reporting(sinks.count_measurement_failure)
        try:
            measurement = await observer.finish(
                end=end,
                started_at=self.started_at,
                status_code=self.status,
                error_type=error,
                error_message=message,
                counter=counting,
                trace_id=request_scope.trace_id,
                redact=self.redact,
            )
        except Exception:
            # Still one record (status, e2e, the transport's error type), so the request
            # is counted and the in-flight gauge comes down.
            log.exception("measuring a request failed")
            sinks.count_measurement_failure("finish")
            measurement = bare_record(
                observer.request,
                status_code=self.status,
                started_at=self.started_at,
                e2e=end - observer.start,
                error_type=error,
                error_message=None if message is None else self.redact(message),
                trace_id=request_scope.trace_id,
            )
        if observer.unread_body:  # an answer too large to keep, whose ends told nothing
            sinks.count_measurement_failure("body_too_large")
        if self.retrieves is not None:
            self._retrieved(measurement, self.retrieves)
            return
        sinks.end(request_scope, measurement)
        if left_unfinished(observer.request, measurement):
            # its tokens are left to the first retrieval that sees the response finished
            assert measurement.response_id is not None
            self.context.background.add(
                measurement.response_id, observer.request, request_scope.labels
            )

    def _retrieved(self, measurement: Measurement, response_id: str) -> None:
        """A retrieval's end: a passthrough in every count, as any GET the proxy does not
        measure; the first that sees its response finished adds the response's tokens
        with its POST's labels (`Sinks.late_tokens`), and the id is forgotten."""
        sinks = self.context.sinks
        sinks.passthrough(route_template(self.path), self.status)
        if not settled(measurement):
            return
        pending = self.context.background.take(response_id)
        tokens = late_tokens(measurement, response_id)
        if pending is not None and tokens is not None:
            sinks.late_tokens(tokens, pending[1])

    def finish_soon(self, failure: Failure | None) -> None:
        """`finish` from a callback: at once when it awaits nothing (no tokenizer to
        count with), else in a task."""
        run_soon(self.finish(perf_counter(), failure), now=self.context.counter is None)

    def redact(self, message: str) -> str:
        return redact(message, self.headers, self.context.settings.secret_headers, self.query)


def run_soon(coroutine: Coroutine[Any, Any, None], *, now: bool) -> None:
    """Run a coroutine to its end right here when `now` says it awaits nothing, else as a
    task: a record lands as the response's last byte goes out, with no task switch."""
    if now:
        try:
            coroutine.send(None)
        except StopIteration:
            return
        except Exception:  # finish contains its own failures; this is a last guard
            log.exception("finishing a request failed")
            return
        coroutine.close()
        log.error("the finish sequence awaited without a tokenizer; its record is lost")
        return
    asyncio.get_running_loop().create_task(coroutine)


class IdleTimer(Deadline):
    """Cuts a relay when the upstream sends nothing for `limit` seconds, or the client
    takes nothing for as long while it holds the upstream up (nginx's send_timeout: a
    client that stopped reading would hold the backend's generation for good).

    One timer per response (proxy/server/deadline.py), not one per chunk as a transport's
    read timeout would arm (about 3 µs a chunk): the data path only notes when it starts
    waiting on the upstream (`waiting`) and when a read ended (`read`; `waiting` is then
    None until the next read starts, so a slow client is not taken for a silent
    upstream). While the client holds a read up, the bytes it owes (proxy/server/
    backlog.py) shrinking at a look is progress; without its transport (another ASGI
    server), a send blocked for `limit` is a stall.
    """

    __slots__ = ("client", "cut", "limit", "progress", "read", "waiting")

    def __init__(
        self,
        limit: float,
        cut: Callable[[Cause], None],
        client: asyncio.WriteTransport | None = None,
    ) -> None:
        self.limit = limit
        self.cut = cut
        self.client = client
        self.waiting: float | None = None
        self.read = perf_counter()
        self.progress = Progress()
        Deadline.__init__(self)
        self.due_within(limit)

    def time_left(self) -> float | None:
        now = perf_counter()
        if self.waiting is None:  # passing the last read on: the client holds it up
            waited = self.progress.stalled_for(self.read, self.client, now)
            cause = Cause.CLIENT_STALLED
        else:
            waited, cause = now - self.waiting, Cause.IDLE_TIMEOUT
        if waited >= self.limit:
            self.cut(cause)
            return None
        return self.limit - waited

    def cancel(self) -> None:
        self.cancel_deadline()
