"""The OTLP metrics sink as the standard OTEL_* variables ask for it, exporting already:
the exporter (otlp over http/protobuf or grpc, or console), the interval and timeout, the
temporality, the name sets; and the counter of failed exports."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry.sdk.metrics.export import MetricExporter
from prometheus_client import CollectorRegistry, Counter, Gauge

from proxy.settings import SettingsError, number, positive_int
from proxy.sinks import otel_env, semconv
from proxy.sinks.cost import PriceTable
from proxy.sinks.otlp.sink import OtlpMetrics

TEMPORALITIES = ("cumulative", "delta", "lowmemory")


def metric_export_failures(registry: CollectorRegistry) -> Counter:
    """`tokenprobe_metric_export_failures_total{reason}`, as for traces."""
    return Counter(
        "tokenprobe_metric_export_failures",
        "OTLP metric exports that failed or timed out (reason=export), from the export "
        "thread handing a batch to the exporter to its answer; with delta temporality that "
        "interval's points are lost, with cumulative the next export carries them.",
        ("reason",),
        registry=registry,
    )


def otlp_metrics_from_env(
    environ: Mapping[str, str],
    *,
    upstream: str,
    registry: CollectorRegistry,
    models: Callable[[str], str],
    attribution: tuple[str, ...] = (),
    prices: PriceTable | None = None,
    in_flight: Gauge | None = None,
    miss_ratio: float = 0.5,
) -> OtlpMetrics:
    """The sink OTEL_* asks for, exporting already. Raises SettingsError naming a bad one."""
    env = otel_env.otel_env(environ)
    names = otel_env.exporters(env, "metrics")
    temporality, interval_ms, timeout_ms = _schedule(env)
    sink = OtlpMetrics(
        _exporter("otlp" if "otlp" in names else "console", env),
        upstream=upstream,
        failures=metric_export_failures(registry),
        models=models,
        resource=otel_env.resource(env),
        interval=interval_ms / 1000,
        export_timeout=timeout_ms / 1000,
        # lowmemory is delta for counters and histograms, cumulative for up-down counters:
        # the same as delta here, where the one up-down counter is always cumulative.
        delta=temporality != "cumulative",
        attribution=attribution,
        prices=prices,
        in_flight=in_flight,
        names=semconv.names_from_env(env),
        miss_ratio=miss_ratio,
    )
    return sink.start()


def check_metrics_env(environ: Mapping[str, str]) -> None:
    """Every OTEL_* value `otlp_metrics_from_env` parses, parsed alike, with no exporter
    built and nothing exporting: SettingsError naming a bad one."""
    env = otel_env.otel_env(environ)
    _schedule(env)
    if "otlp" in otel_env.exporters(env, "metrics"):
        otel_env.otlp_target(env, "metrics")


def _schedule(env: Mapping[str, str]) -> tuple[str, int, float]:
    """The temporality, the export interval and the export timeout (ms) OTEL_* asks for."""
    key = "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE"
    temporality = env.get(key, "cumulative").lower()
    if temporality not in TEMPORALITIES:
        raise SettingsError(f"{key}={env[key]!r}: expected one of {', '.join(TEMPORALITIES)}")
    interval_ms: int = otel_env.value(env, "OTEL_METRIC_EXPORT_INTERVAL", positive_int, 60_000)
    timeout_ms: float = otel_env.value(env, "OTEL_METRIC_EXPORT_TIMEOUT", number, 30_000.0)
    return temporality, interval_ms, timeout_ms


def _exporter(name: str, env: Mapping[str, str]) -> MetricExporter:
    if name == "console":
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

        return ConsoleMetricExporter()
    target = otel_env.otlp_target(env, "metrics")
    options: dict[str, Any] = {
        "endpoint": target.endpoint,
        "headers": target.headers,
        "timeout": target.timeout,
    }
    if target.protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        return OTLPMetricExporter(**options)
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
        OTLPMetricExporter as GrpcMetricExporter,
    )

    return GrpcMetricExporter(**options)
