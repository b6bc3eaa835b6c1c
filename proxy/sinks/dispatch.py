"""Where finished measurements go: metrics, traces, logs, cost. Sink failures stop here.

The relay calls `begin` when a request starts (in-flight gauge, trace span) and `end` once
with the frozen record. A failing sink is logged and counted in
`tokenprobe_measurement_failures_total{stage="sink"}`; it never fails the request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Any, Protocol

from proxy.core.labels import ModelLabels
from proxy.core.measurement import ErrorType, Measurement
from proxy.core.observe import bare_record
from proxy.core.request import RequestInfo
from proxy.sinks.keys import KeyLabels
from proxy.sinks.metrics import Metrics

log = logging.getLogger("tokenprobe")

Headers = list[tuple[bytes, bytes]]


class RequestTracer(Protocol):
    def start(
        self, info: RequestInfo, headers: Headers, start_time_ns: int | None = None
    ) -> tuple[Any, str | None, Headers]:
        """Open a span that began at start_time_ns (wall clock): (span, trace id if
        sampled, trace headers to send upstream in place of the client's)."""

    def finish(self, span: Any, measurement: Measurement | None) -> None: ...

    def shutdown(self) -> None:
        """Flush what is queued; blocking, called off the event loop at exit."""


class RequestScope:
    __slots__ = ("info", "key_label", "model_label", "span", "trace_id", "upstream_headers")

    def __init__(self, info: RequestInfo | None, model_label: str) -> None:
        self.info = info
        self.model_label = model_label
        self.key_label: str | None = None
        self.span: Any = None
        self.trace_id: str | None = None
        self.upstream_headers: Headers = []


class Sinks:
    def __init__(
        self,
        metrics: Metrics,
        labels: ModelLabels,
        *,
        tracer: RequestTracer | None = None,
        consumers: Sequence[Callable[[Measurement, str], None]] = (),
        keys: KeyLabels | None = None,
    ) -> None:
        self.metrics = metrics
        self.labels = labels
        self.tracer = tracer
        # Each consumer gets the record and its bounded model label (logs, cost, ...).
        self.consumers = list(consumers)
        self.keys = keys

    def begin(
        self, info: RequestInfo | None, headers: Headers, started_at: float = 0.0
    ) -> RequestScope:
        if info is None:
            return RequestScope(None, "")
        rs = RequestScope(info, self.labels(info.model))
        self.metrics.in_flight.labels(rs.model_label, info.endpoint).inc()
        if self.keys is not None:
            rs.key_label = self.keys(headers)
        if self.tracer is not None:
            try:
                rs.span, rs.trace_id, rs.upstream_headers = self.tracer.start(
                    info, headers, int(started_at * 1e9) if started_at else None
                )
            except Exception:
                log.exception("starting a trace span failed")
                self.failed("trace")
        return rs

    def end(self, rs: RequestScope, measurement: Measurement | None) -> None:
        info = rs.info
        if info is None:
            return
        self.metrics.in_flight.labels(rs.model_label, info.endpoint).dec()
        if self.tracer is not None and rs.span is not None:
            self._safely(self.tracer.finish, rs.span, measurement)
        if measurement is None:
            return
        self._safely(self.metrics.record, measurement, rs.model_label)
        if rs.key_label is not None:
            self._safely(self.metrics.record_key, measurement, rs.model_label, rs.key_label)
        for consumer in self.consumers:
            self._safely(consumer, measurement, rs.model_label)

    def refused(
        self, info: RequestInfo, error: ErrorType, status: int, start: float, started_at: float
    ) -> None:
        """A measured request that never went upstream (too large, too slow, client gone)."""
        m = bare_record(
            info,
            status_code=status,
            started_at=started_at,
            e2e=perf_counter() - start,
            error_type=error,
        )
        label = self.labels(info.model)
        self._safely(self.metrics.record, m, label)
        for consumer in self.consumers:
            self._safely(consumer, m, label)

    def passthrough(self, route: str, status: int) -> None:
        self.metrics.passthrough.labels(route, str(status)).inc()

    def failed(self, stage: str) -> None:
        self.metrics.measurement_failures.labels(stage).inc()

    def _safely(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("a measurement sink failed")
            self.failed("sink")
