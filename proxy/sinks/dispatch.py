"""Where finished measurements go: every sink, and the tracer. Sink failures stop here.

The relay calls `begin` when a request starts (in-flight gauge, labels, trace span) and
`end` once with the record, which each sink in the list then gets with the
request's Labels. A failing sink is logged and counted in
`tokenprobe_measurement_failures_total{stage="sink"}`; it never fails the request, and
the sinks after it still run.

A WebSocket session takes the same road: `session_started` when its upgrade request is
admitted (the in-flight gauge), `session_ended` once with its record (proxy/core/
wsrecord.py), which every `SessionSink` among the sinks gets (Prometheus, OTLP, the access
log), each failure caught and counted as `end`'s are. Each record its API makes (a
realtime utterance) comes by `record`, to every sink and, with its span, to the tracer.

A background Response's tokens, which its POST's record did not have, come later by
`late_tokens` (proxy/core/background.py): to every `LateTokensSink` (the token counters of
Prometheus and OTLP, a line of the access log) with the POST's labels.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from time import perf_counter, time
from typing import Any

from proxy.core.background import LateTokens
from proxy.core.labels import NO_VALUE, HeaderLabels, Ledger, ModelLabels
from proxy.core.measurement import ErrorType, Measurement
from proxy.core.observe import bare_record
from proxy.core.request import RequestInfo
from proxy.core.wsrecord import WsSessionRecord
from proxy.sinks.conversations import ConversationTracker
from proxy.sinks.keys import KeyLabels
from proxy.sinks.metrics import Metrics
from proxy.sinks.sink import (
    Headers,
    Labels,
    LateTokensSink,
    RequestTracer,
    SessionSink,
    Sink,
)

log = logging.getLogger("tokenprobe")

_UNMEASURED = Labels(model="")


class RequestScope:
    """What the sinks keep of one request between `begin` and `end`: its labels, resolved
    once, and its trace span with the trace id and the `traceparent` that goes upstream."""

    __slots__ = ("in_flight", "info", "labels", "span", "trace_id", "turn", "upstream_headers")

    def __init__(self, info: RequestInfo | None, labels: Labels) -> None:
        self.info = info
        self.labels = labels
        self.span: Any = None
        self.trace_id: str | None = None
        self.upstream_headers: Headers = []
        self.turn: Any = None  # its conversation turn (proxy/sinks/conversations.py)
        self.in_flight: Any = None  # its in-flight gauge child, resolved at `begin`


class Sinks:
    """The sinks in order, the tracer, and the label resolvers they share.

    `metrics` is also in `sinks` (it records each request like any sink); it is named
    here too for what only the dispatcher does: the in-flight gauge, unmeasured
    passthrough requests and measurement failures.
    """

    def __init__(
        self,
        sinks: Sequence[Sink],
        *,
        metrics: Metrics,
        models: ModelLabels,
        keys: KeyLabels | None = None,
        tracer: RequestTracer | None = None,
        attribution: tuple[tuple[str, str], ...] = (),
        max_label_values: int = 50,
        ledger: Callable[[str], Ledger] | None = None,
        conversations: ConversationTracker | None = None,
    ) -> None:
        """`attribution`: the (header, label) pairs of --label-header; `ledger`: each
        bounded label's ledger by the label's name, where several processes share the
        bound; `conversations`: the tracker that gives each request its conversation
        and turn."""
        self.conversations = conversations
        self.sinks = list(sinks)
        self.session_sinks = [sink for sink in self.sinks if isinstance(sink, SessionSink)]
        self.late_sinks = [sink for sink in self.sinks if isinstance(sink, LateTokensSink)]
        self.metrics = metrics
        self.models = models
        self.keys = keys
        self.tracer = tracer
        self.label_names = tuple(label for _, label in attribution)
        self.header_labels = (
            HeaderLabels(
                tuple(h for h, _ in attribution),
                max_label_values,
                tuple(ledger(label) for _, label in attribution) if ledger else None,
            )
            if attribution
            else None
        )
        self._no_attribution = (NO_VALUE,) * len(attribution)

    def begin(
        self,
        info: RequestInfo | None,
        headers: Headers,
        started_at: float = 0.0,
        keys_checked: bool = True,
    ) -> RequestScope:
        """`keys_checked`: the backend checks this request's API key (proxy/sinks/keys.py
        `checks_keys`), so its answer may admit a new key's label."""
        if info is None:
            return RequestScope(None, _UNMEASURED)
        key = self.keys(headers, keys_checked) if self.keys is not None else None
        attribution = self.header_labels(headers) if self.header_labels is not None else ()
        # A new key's label is a candidate until `end` settles it (proxy/sinks/keys.py):
        # nothing between reads it (the in-flight gauge and spans carry no key).
        scope = RequestScope(info, Labels(self.models(info.model), key, attribution))
        scope.in_flight = self.metrics.in_flight_of(scope.labels.model, info.endpoint)
        scope.in_flight.inc()
        if self.conversations is not None:
            try:
                scope.turn = self.conversations.begin(info, headers, started_at or time())
            except Exception:
                log.exception("finding a request's conversation failed")
                self.count_measurement_failure("conversation")
        if self.tracer is not None:
            try:
                scope.span, scope.trace_id, scope.upstream_headers = self.tracer.start(
                    info, headers, int(started_at * 1e9) if started_at else None
                )
                if attribution and scope.span is not None:
                    scope.span.set_attributes(dict(zip(self.label_names, attribution, strict=True)))
            except Exception:
                log.exception("starting a trace span failed")
                self.count_measurement_failure("trace")
        return scope

    def end(self, scope: RequestScope, measurement: Measurement | None) -> None:
        info = scope.info
        if info is None:
            return
        scope.in_flight.dec()
        if scope.turn is not None and measurement is not None and self.conversations is not None:
            try:
                measurement = self.conversations.end(scope.turn, measurement, scope.labels.model)
            except Exception:
                log.exception("recording a request's conversation failed")
                self.count_measurement_failure("conversation")
        if self.tracer is not None and scope.span is not None:
            self._safely(self.tracer.finish, scope.span, measurement)
        if measurement is not None:
            key = scope.labels.key
            if key is not None and self.keys is not None:
                settled = self.keys.settle(key, measurement)
                if settled is not key:  # a new key: admitted, or `rejected`/`other`
                    # for the record and for what comes later (a background's tokens)
                    scope.labels = replace(scope.labels, key=settled)
            self._record(measurement, scope.labels)

    def refused(
        self,
        info: RequestInfo,
        error: ErrorType,
        status: int,
        start: float,
        started_at: float,
        message: str | None = None,
    ) -> None:
        """A measured request that never went upstream (too large, too slow, client gone);
        `message` what the proxy answered it (its own words: no secret in them). No span:
        the CLIENT span is the call upstream, and none was made."""
        m = bare_record(
            info,
            status_code=status,
            started_at=started_at,
            e2e=perf_counter() - start,
            error_type=error,
            error_message=message,
        )
        self._record(m, Labels(self.models(info.model)))

    def record(
        self, measurement: Measurement, key: str | None = None, headers: Headers | None = None
    ) -> None:
        """A record made outside the HTTP relay (a WebSocket session's turn): the model
        label is resolved here; `key` is what `keys` gave the session at its start,
        settled here with each turn (the first the upstream answered admits a new key);
        `headers` the upgrade request's, whose `traceparent` the turn's span joins."""
        if key is not None and self.keys is not None:
            key = self.keys.settle(key, measurement)
        if self.tracer is not None:
            self._trace_whole(self.tracer, measurement, headers or [])
        self._record(measurement, Labels(self.models(measurement.model), key))

    def _trace_whole(self, tracer: RequestTracer, m: Measurement, headers: Headers) -> None:
        """The CLIENT span of a record that comes whole (a realtime utterance: no request
        opened it, its session did), made now, once: opened at the record's start and
        ended at its end (`finish`), as an HTTP request's span is, with its events at their
        instants, under the client's `traceparent` if the upgrade request had one. Its
        trace id goes on the record, for the log line and the exemplars. The tracer reads
        only the trace headers among `headers`: no other value reaches the span."""
        request = RequestInfo(
            endpoint=m.endpoint,
            model=m.model,
            stream=m.stream,
            usage_requested=False,
            max_tokens=m.max_tokens,
            temperature=m.temperature,
        )
        try:
            span, m.trace_id, _ = tracer.start(request, headers, int(m.started_at * 1e9))
        except Exception:
            log.exception("starting a trace span failed")
            self.count_measurement_failure("trace")
            return
        self._safely(tracer.finish, span, m)

    def session_started(self, route: str) -> None:
        """A WebSocket upgrade request was admitted: in flight on its route until it ends."""
        self.metrics.ws.for_route(route)[0].inc()

    def session_ended(self, record: WsSessionRecord) -> None:
        """A WebSocket tunnel ended (once per `session_started`): its record to every
        sink that reports sessions."""
        self.metrics.ws.for_route(record.route)[0].dec()
        for sink in self.session_sinks:
            self._safely(sink.session, record)

    def late_tokens(self, tokens: LateTokens, labels: Labels) -> None:
        """A background Response's tokens, counted when a retrieval first saw it finished
        (proxy/core/background.py), with its POST's labels: to every sink that counts
        tokens, and nothing else (the POST had its record, in-flight count and span)."""
        if len(labels.attribution) != len(self.label_names):
            labels = replace(labels, attribution=self._no_attribution)
        for sink in self.late_sinks:
            self._safely(sink.late_tokens, tokens, labels)

    def passthrough(self, route: str, status: int) -> None:
        metrics = self.metrics
        metrics.child(metrics.passthrough, route, str(status)).inc()

    def usage_injection_refused(self, unplaced: tuple[str, ...]) -> None:
        """`tokenprobe_measurement_failures_total{stage="usage_injection"}`: the proxy
        stops asking its upstream for usage (proxy/core/strip.py Injection)."""
        self.count_measurement_failure("usage_injection")
        log.warning(
            "the upstream moved %s onto the usage chunk the proxy asked for, and the proxy "
            "cannot put it back: it no longer asks this upstream for usage",
            ", ".join(unplaced),
        )

    def usage_comes_unasked(self, endpoint: str) -> None:
        """The upstream streams usage on this API without being asked (vLLM's
        --enable-force-include-usage, llama.cpp's completions): the proxy stops asking and
        stripping there (proxy/core/strip.py). No failure: token counts still come from usage."""
        log.info(
            "the upstream writes usage on %s streams that did not ask for it (vLLM's "
            "--enable-force-include-usage, llama.cpp's completions): the proxy no longer asks "
            "it for usage there, and passes its usage to clients as it comes",
            endpoint,
        )

    def count_measurement_failure(self, stage: str) -> None:
        """`tokenprobe_measurement_failures_total{stage}`: measuring broke, the request did not."""
        self.metrics.measurement_failures.labels(stage).inc()

    def count_upstream_protocol_error(self, kind: str) -> None:
        """`tokenprobe_upstream_protocol_errors_total{kind}`: an upstream connection closed
        for breaking HTTP/1.1 (proxy/sinks/metrics.py UPSTREAM_PROTOCOL_ERRORS)."""
        self.metrics.upstream_protocol.inc(kind)

    def _record(self, measurement: Measurement, labels: Labels) -> None:
        if len(labels.attribution) != len(self.label_names):
            # A record made without the request's headers (refused before they were
            # resolved, say): its attribution labels are "none".
            labels = replace(labels, attribution=self._no_attribution)
        for sink in self.sinks:
            self._safely(sink.record, measurement, labels)

    def _safely(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("a measurement sink failed")
            self.count_measurement_failure("sink")
