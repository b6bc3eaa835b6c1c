"""Span export in the background, and counting what it loses.

Spans go through a batch processor on its own thread, so a slow or dead collector never
holds up a stream; the spans it loses are counted in
`tokenprobe_trace_export_failures_total{reason}`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from prometheus_client import CollectorRegistry, Counter

from proxy.sinks.otel_env import OtlpTarget

log = logging.getLogger("tokenprobe")


def export_failures(registry: CollectorRegistry) -> Counter:
    """`tokenprobe_trace_export_failures_total{reason}`, registered once per registry."""
    return Counter(
        "tokenprobe_trace_export_failures",
        "Trace spans lost before reaching the collector, by reason: export (the exporter "
        "failed or timed out) or queue_full (spans ended faster than the collector took "
        "them and the oldest queued ones were dropped).",
        ("reason",),
        registry=registry,
    )


class CountingBatchProcessor(SpanProcessor):
    """A BatchSpanProcessor that counts the spans it loses.

    Two ways to lose a span: the exporter fails or times out (`reason="export"`), or spans
    end faster than the collector takes them and the queue drops the oldest
    (`reason="queue_full"`). The SDK only logs the second, so the queue length is mirrored
    here: +1 when a sampled span ends, -n when the worker takes a batch of n.
    """

    def __init__(
        self,
        exporter: SpanExporter,
        failures: Counter,
        *,
        max_queue_size: int = 2048,
        schedule_delay_millis: float = 5000,
        max_export_batch_size: int = 512,
    ) -> None:
        self._failed = failures.labels("export")
        self._dropped = failures.labels("queue_full")
        self._lock = threading.Lock()
        self._queued = 0
        self._limit = max_queue_size
        self._batch = BatchSpanProcessor(
            _CountingExporter(exporter, self),
            max_queue_size=max_queue_size,
            schedule_delay_millis=schedule_delay_millis,
            max_export_batch_size=min(max_export_batch_size, max_queue_size),
        )

    def on_start(self, span: Any, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is None or not span.context.trace_flags.sampled:
            return  # the batch processor ignores these too
        with self._lock:
            if self._queued >= self._limit:
                self._dropped.inc()  # the batch queue drops its oldest to take this one
            else:
                self._queued += 1
        self._batch.on_end(span)

    def taken(self, count: int) -> None:
        with self._lock:
            self._queued = max(0, self._queued - count)

    def count_failed_export(self, count: int) -> None:
        self._failed.inc(count)

    def shutdown(self) -> None:
        self._batch.shutdown()  # type: ignore[no-untyped-call]

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self._batch.force_flush(timeout_millis)


class _CountingExporter(SpanExporter):
    def __init__(self, exporter: SpanExporter, counts: CountingBatchProcessor) -> None:
        self.exporter = exporter
        self.counts = counts

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.counts.taken(len(spans))
        try:
            result = self.exporter.export(spans)
        except Exception:
            log.exception("exporting trace spans failed")
            result = SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS:
            self.counts.count_failed_export(len(spans))
        return result

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self.exporter.force_flush(timeout_millis)


def otlp_span_exporter(target: OtlpTarget) -> SpanExporter:
    """The SDK's OTLP span exporter for `target` (imported only when traces are on)."""
    if target.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcSpanExporter,
        )

        return GrpcSpanExporter(
            endpoint=target.endpoint, headers=target.headers, timeout=target.timeout
        )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(
        endpoint=target.endpoint, headers=target.headers, timeout=target.timeout
    )
