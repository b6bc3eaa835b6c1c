"""The schema URL the spans and the OTLP metrics carry: one, on both signals' scopes and
resources, naming the core semantic conventions' version their non-GenAI attributes follow
(proxy/sinks/semconv.py SCHEMA_URL says why 1.45.0). Before, the metrics named 1.42.0 and
the spans none."""

from __future__ import annotations

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from proxy.core.labels import ModelLabels
from proxy.core.request import CHAT, RequestInfo
from proxy.sinks.otlp import OtlpMetrics, metric_export_failures
from proxy.sinks.sink import Labels
from proxy.sinks.tracing import Tracing
from tests.factories import measurement
from tests.sinks.test_otlp_sink import Collecting

#: What semantic-conventions-genai v0.1.0, the release of the gen_ai.* names exported,
#: "Depends on" (its CHANGELOG.md): the core version of server.*, error.type and the rest.
CORE_SCHEMA = "https://opentelemetry.io/schemas/1.45.0"


def test_spans_and_metrics_name_the_same_schema_on_scope_and_resource() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing([SimpleSpanProcessor(exporter)], upstream="http://vllm:8000")
    try:
        request = RequestInfo(CHAT, "sim-model", True, True, None, None)
        span, _, _ = tracing.start(request, [])
        tracing.finish(span, measurement())
        (finished,) = exporter.get_finished_spans()
    finally:
        tracing.shutdown()
    otlp = OtlpMetrics(
        Collecting(),
        upstream="http://vllm:8000",
        failures=metric_export_failures(CollectorRegistry()),
        models=ModelLabels(("sim-model",)),
        resource=Resource.create({}),
    )
    otlp.record(measurement(), Labels("sim-model"))
    data = otlp.collect()
    assert data is not None
    (resource_metrics,) = data.resource_metrics
    (scope_metrics,) = resource_metrics.scope_metrics
    assert finished.instrumentation_scope is not None
    assert finished.instrumentation_scope.schema_url == CORE_SCHEMA
    assert scope_metrics.schema_url == CORE_SCHEMA
    assert finished.resource.schema_url == resource_metrics.schema_url == CORE_SCHEMA
    # the service name survives the schema URL's setting
    assert finished.resource.attributes["service.name"] == "tokenprobe"
