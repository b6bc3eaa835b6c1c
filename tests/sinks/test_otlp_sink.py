"""The OTLP metrics sink in process: its aggregation against prometheus-client's for the same
records, delta temporality, export failures, and the OTEL_* variables it reads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    MetricExporter,
    MetricExportResult,
    MetricsData,
)
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry

from proxy.core.labels import ModelLabels
from proxy.core.measurement import ErrorType, TokenSource
from proxy.settings import SettingsError
from proxy.sinks.cost import parse_prices
from proxy.sinks.metrics import Metrics
from proxy.sinks.otel_env import metrics_requested, otlp_target
from proxy.sinks.otlp import (
    DURATION_BUCKETS,
    OtlpMetrics,
    metric_export_failures,
    otlp_metrics_from_env,
)
from proxy.sinks.semconv import Names, names_from_env
from proxy.sinks.sink import Labels
from tests.factories import measurement


class Collecting(MetricExporter):
    """Keeps what it is given; fails when told to."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__(preferred_temporality={}, preferred_aggregation={})
        self.fail = fail
        self.exported: list[MetricsData] = []

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        if self.fail:
            raise ConnectionError("collector gone")
        self.exported.append(metrics_data)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        pass


def sink(exporter: MetricExporter, registry: CollectorRegistry, **kw: Any) -> OtlpMetrics:
    return OtlpMetrics(
        exporter,
        upstream="http://vllm:8000",
        failures=metric_export_failures(registry),
        models=ModelLabels(("sim-model",)),
        resource=Resource.create({}),
        **kw,
    )


def by_name(data: MetricsData) -> dict[str, Any]:
    (rm,) = data.resource_metrics
    (sm,) = rm.scope_metrics
    return {m.name: m for m in sm.metrics}


def records() -> Sequence[Any]:
    # Values on bucket bounds on purpose: both sides count a bound as its own bucket's (le).
    return [
        measurement(e2e=0.08, ttft=0.04, inter_token_latencies=(0.01, 0.01, 0.02, 0.0)),
        measurement(e2e=81.92, ttft=100.0, inter_token_latencies=()),
        measurement(
            stream=False, ttft=None, tpot=None, inter_token_latencies=(), response_model="x"
        ),
        measurement(
            error_type=ErrorType.UPSTREAM_TIMEOUT,
            status_code=504,
            output_tokens=None,
            inter_token_latencies=(),
        ),
    ]


#: Each name set (proxy/sinks/semconv.py): the switch, its duration, per-chunk and
#: first-chunk histograms.
NAME_SETS = {
    "current": (Names(), "gen_ai.client.inference"),
    "previous": (Names(current=False, previous=True), "gen_ai.client.operation"),
}


@pytest.mark.parametrize("name_set", NAME_SETS)
def test_buckets_counts_and_sums_equal_prometheus_for_the_same_records(name_set: str) -> None:
    names, prefix = NAME_SETS[name_set]
    registry = CollectorRegistry()
    prom = Metrics(registry)
    exporter = Collecting()
    otlp = sink(exporter, registry, names=names)
    for m in records():
        prom.record(m, Labels("sim-model"))
        otlp.record(m, Labels("sim-model"))
    metrics = by_name(otlp.collect())  # type: ignore[arg-type]
    other = NAME_SETS["previous" if name_set == "current" else "current"][1]
    assert not any(name.startswith(other) for name in metrics)  # one set, not both
    duration = metrics[f"{prefix}.duration"]
    assert duration.unit == "s"
    points = duration.data.data_points
    assert sum(p.count for p in points) == 4
    assert sum(p.sum for p in points) == pytest.approx(
        registry.get_sample_value(
            "tokenprobe_e2e_request_latency_seconds_sum",
            {"model": "sim-model", "endpoint": "/v1/chat/completions"},
        )
    )
    (failed,) = [p for p in points if "error.type" in p.attributes]
    assert failed.attributes["error.type"] == "upstream_timeout"
    # "x" is no model the proxy vouches for: left out, never the label's "other"
    assert {p.attributes.get("gen_ai.response.model") for p in points} == {None}
    ok = [p for p in points if "error.type" not in p.attributes]
    assert list(ok[0].explicit_bounds) == list(DURATION_BUCKETS)
    counts = [sum(c) for c in zip(*(p.bucket_counts for p in points), strict=True)]
    assert counts[3] == 1 and counts[13] == 1  # 0.08 in (0.04, 0.08], 81.92 in (40.96, 81.92]
    chunks = metrics[f"{prefix}.time_per_output_chunk"].data.data_points
    itl = {"model": "sim-model", "endpoint": "/v1/chat/completions"}
    assert sum(p.count for p in chunks) == registry.get_sample_value(
        "tokenprobe_inter_token_latency_seconds_count", itl
    )
    (chunk_point,) = [p for p in chunks if p.count == 4]
    assert list(chunk_point.bucket_counts[:3]) == [3, 1, 0]  # 0.0, 0.01, 0.01 | 0.02
    assert (chunk_point.min, chunk_point.max) == (0.0, 0.02)
    ttft = metrics[f"{prefix}.time_to_first_chunk"].data.data_points
    assert sum(p.bucket_counts[-1] for p in ttft) == 1  # 100 s: the overflow bucket
    output = registry.get_sample_value(
        "tokenprobe_generation_tokens_total",
        {"model": "sim-model", "endpoint": "/v1/chat/completions", "source": "usage"},
    )
    assert output == 16 * 3  # the failure reported none
    if name_set == "previous":
        usage = metrics["gen_ai.client.token.usage"].data.data_points
        out = [p for p in usage if p.attributes["gen_ai.token.type"] == "output"]
        assert sum(p.sum for p in out) == output
    else:
        counter = metrics["gen_ai.client.inference.usage.output_tokens"].data
        assert counter.is_monotonic and sum(p.value for p in counter.data_points) == output
        # Every request counted, the failure with 0; tokens not split by modality.
        assert {p.attributes["gen_ai.token.modality"] for p in counter.data_points} == {"unknown"}
        # Per request, the failure too (with 0 and its error.type); not split by modality.
        per_request = metrics["gen_ai.client.inference.operation.output_tokens"].data.data_points
        assert sum(p.count for p in per_request) == 4 and sum(p.sum for p in per_request) == output
        assert "gen_ai.token.modality" not in per_request[0].attributes
        inputs = metrics["gen_ai.client.inference.usage.input_tokens"].data.data_points
        assert sum(p.value for p in inputs) == 12 * 4
        (timed_out,) = [
            p
            for p in metrics["gen_ai.client.inference.operation.input_tokens"].data.data_points
            if "error.type" in p.attributes
        ]
        assert timed_out.attributes["error.type"] == "upstream_timeout"
    requests = metrics["tokenprobe.requests"].data
    assert requests.is_monotonic and sum(p.value for p in requests.data_points) == 4
    for p in points:
        assert p.attributes["server.address"] == "vllm" and p.attributes["server.port"] == 8000


def test_delta_temporality_starts_each_interval_from_zero() -> None:
    registry = CollectorRegistry()
    otlp = sink(Collecting(), registry, delta=True)
    otlp.record(measurement(), Labels("sim-model"))
    first = by_name(otlp.collect())  # type: ignore[arg-type]
    duration = first["gen_ai.client.inference.duration"].data
    assert duration.aggregation_temporality is AggregationTemporality.DELTA
    assert otlp.collect() is None  # nothing new
    otlp.record(measurement(), Labels("sim-model"))
    otlp.record(measurement(), Labels("sim-model"))
    second = by_name(otlp.collect())  # type: ignore[arg-type]
    (point,) = second["gen_ai.client.inference.duration"].data.data_points
    assert point.count == 2
    assert point.start_time_unix_nano >= duration.data_points[0].time_unix_nano


def test_a_failing_export_is_counted_and_recording_goes_on() -> None:
    registry = CollectorRegistry()
    otlp = sink(Collecting(fail=True), registry)
    otlp.record(measurement(), Labels("sim-model"))
    assert otlp.export_once() is False
    otlp.record(measurement(), Labels("sim-model"))
    assert otlp.export_once() is False
    value = registry.get_sample_value(
        "tokenprobe_metric_export_failures_total", {"reason": "export"}
    )
    assert value == 2


def test_cost_in_flight_and_attribution_attributes() -> None:
    registry = CollectorRegistry()
    prom = Metrics(registry, ("team",))
    prices = parse_prices({"currency": "EUR", "models": {"sim-model": {"input": 1, "output": 2}}})
    otlp = sink(
        Collecting(), registry, prices=prices, in_flight=prom.in_flight, attribution=("team",)
    )
    prom.in_flight.labels("sim-model", "/v1/chat/completions").inc()
    otlp.record(measurement(prompt_tokens=1_000_000), Labels("sim-model", attribution=("red",)))
    metrics = by_name(otlp.collect())  # type: ignore[arg-type]
    cost = metrics["tokenprobe.cost"]
    assert cost.unit == "{EUR}"
    spend = {p.attributes["tokenprobe.cost.kind"]: p.value for p in cost.data.data_points}
    assert spend == {"input": 1.0, "output": 16 * 2 / 1e6}
    (flying,) = metrics["tokenprobe.requests.in_flight"].data.data_points
    assert flying.value == 1 and not metrics["tokenprobe.requests.in_flight"].data.is_monotonic
    for name in ("gen_ai.client.inference.duration", "tokenprobe.requests"):
        assert {p.attributes["team"] for p in metrics[name].data.data_points} == {"red"}


def test_the_variables_choose_protocol_endpoint_and_temporality() -> None:
    assert not metrics_requested({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
    assert metrics_requested({"OTEL_METRICS_EXPORTER": "otlp"})
    assert not metrics_requested({"OTEL_METRICS_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"})
    with pytest.raises(SettingsError, match="OTEL_METRICS_EXPORTER='statsd'"):
        metrics_requested({"OTEL_METRICS_EXPORTER": "statsd"})
    http = otlp_target({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}, "metrics")
    assert (http.protocol, http.endpoint) == ("http/protobuf", "http://c:4318/v1/metrics")
    own = otlp_target(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://m:9/x",
            "OTEL_EXPORTER_OTLP_HEADERS": "a=1",
            "OTEL_EXPORTER_OTLP_METRICS_HEADERS": "b=2",
            "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": "3",
        },
        "metrics",
    )
    assert (own.endpoint, own.headers, own.timeout) == ("http://m:9/x", {"b": "2"}, 3.0)
    grpc = otlp_target(
        {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"},
        "metrics",
    )
    assert (grpc.protocol, grpc.endpoint) == ("grpc", "http://c:4317")
    with pytest.raises(SettingsError, match="OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"):
        otlp_target({"OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "thrift"}, "metrics")
    with pytest.raises(SettingsError, match="TEMPORALITY_PREFERENCE"):
        otlp_metrics_from_env(
            {
                "OTEL_METRICS_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE": "sometimes",
            },
            upstream="http://vllm:8000",
            registry=CollectorRegistry(),
            models=ModelLabels(),
        )


@pytest.mark.parametrize(
    ("value", "current", "previous"),
    [
        ("", True, False),
        ("gen_ai_latest_experimental", True, False),
        ("http/dup, gen_ai_previous", False, True),
        ("gen_ai_previous/dup", True, True),
        ("gen_ai_previous,gen_ai_latest_experimental", True, True),
        ("database", True, False),  # another signal's switch changes nothing here
    ],
)
def test_the_stability_switch_picks_the_name_sets(
    value: str, current: bool, previous: bool
) -> None:
    names = names_from_env({"OTEL_SEMCONV_STABILITY_OPT_IN": value})
    assert (names.current, names.previous) == (current, previous)


def test_both_name_sets_at_once_each_carry_every_request() -> None:
    otlp = sink(Collecting(), CollectorRegistry(), names=Names(current=True, previous=True))
    for m in records():
        otlp.record(m, Labels("sim-model"))
    metrics = by_name(otlp.collect())  # type: ignore[arg-type]
    for name in ("gen_ai.client.inference.duration", "gen_ai.client.operation.duration"):
        assert sum(p.count for p in metrics[name].data.data_points) == 4
    assert "gen_ai.client.token.usage" in metrics
    assert "gen_ai.client.inference.usage.input_tokens" in metrics


def test_reasoning_tokens_are_counted_once_the_record_carries_them() -> None:
    base = measurement()
    later = measurement(reasoning_tokens=9, reasoning_token_source="usage")
    otlp = sink(Collecting(), CollectorRegistry())
    otlp.record(later, Labels("sim-model"))
    otlp.record(base, Labels("sim-model"))  # no reasoning: nothing counted for it
    metrics = by_name(otlp.collect())  # type: ignore[arg-type]
    (point,) = metrics["gen_ai.client.inference.usage.reasoning.output_tokens"].data.data_points
    assert point.value == 9 and point.attributes["gen_ai.token.modality"] == "unknown"


def test_cache_writes_are_counted_where_usage_said_them() -> None:
    """gen_ai.client.inference.usage.cache_write.input_tokens (token-metrics.yaml at
    066d4a7f), as its cache_read twin: the backend's count, 0 included; nothing for a
    request whose usage said none (the current names only: the previous have no such
    counter)."""
    otlp = sink(Collecting(), CollectorRegistry(), names=Names(current=True, previous=True))
    otlp.record(measurement(cache_write_tokens=128), Labels("sim-model"))
    otlp.record(measurement(cache_write_tokens=0), Labels("sim-model"))
    otlp.record(measurement(), Labels("sim-model"))
    metrics = by_name(otlp.collect())  # type: ignore[arg-type]
    (point,) = metrics["gen_ai.client.inference.usage.cache_write.input_tokens"].data.data_points
    assert point.value == 128 and point.attributes["gen_ai.token.modality"] == "unknown"
    previous = sink(Collecting(), CollectorRegistry(), names=Names(current=False, previous=True))
    previous.record(measurement(cache_write_tokens=128), Labels("sim-model"))
    names = by_name(previous.collect())  # type: ignore[arg-type]
    assert "gen_ai.client.inference.usage.cache_write.input_tokens" not in names


@pytest.mark.parametrize("name_set", NAME_SETS)
def test_content_chunks_counted_for_want_of_tokens_are_no_token_usage(name_set: str) -> None:
    """Without usage or a tokenizer the output count is the content chunks, which the
    conventions forbid the usage instruments ("Otherwise it MUST NOT report usage metric",
    gen_ai.client.token.usage); the same for reasoning counted as one per event."""
    names, _ = NAME_SETS[name_set]
    otlp = sink(Collecting(), CollectorRegistry(), names=names)
    counted = measurement(output_tokens=7, reasoning_tokens=5, reasoning_token_source="usage")
    chunks = measurement(
        token_source=TokenSource.CHUNKS,
        prompt_tokens=None,
        output_tokens=30,
        reasoning_tokens=20,
        reasoning_token_source="events",
    )
    for m in (counted, chunks):
        otlp.record(m, Labels("sim-model"))
    metrics = by_name(otlp.collect())  # type: ignore[arg-type]
    if name_set == "previous":
        usage = metrics["gen_ai.client.token.usage"].data.data_points
        out = [p for p in usage if p.attributes["gen_ai.token.type"] == "output"]
        assert (sum(p.count for p in out), sum(p.sum for p in out)) == (1, 7)
        return
    (counter,) = metrics["gen_ai.client.inference.usage.output_tokens"].data.data_points
    assert counter.value == 7
    (reasoning,) = metrics["gen_ai.client.inference.usage.reasoning.output_tokens"].data.data_points
    assert reasoning.value == 5
    per_request = metrics["gen_ai.client.inference.operation.output_tokens"].data.data_points
    assert (sum(p.count for p in per_request), sum(p.sum for p in per_request)) == (1, 7)
    # both requests are still counted where counting them says nothing about tokens
    assert sum(p.count for p in metrics["gen_ai.client.inference.duration"].data.data_points) == 2


def test_a_websocket_session_s_records_and_in_flight_utterances_are_exported() -> None:
    """A realtime utterance is a record like a request's, with the endpoint /v1/realtime,
    which no HTTP Api serves: its attributes come from its WsApi. Before, its record was
    lost and, once its in-flight series existed, every export failed (KeyError)."""
    registry = CollectorRegistry()
    prom = Metrics(registry)
    otlp = sink(Collecting(), registry, in_flight=prom.in_flight)
    prom.in_flight.labels("sim-model", "/v1/realtime").inc()
    otlp.record(measurement(endpoint="/v1/realtime", stream=True), Labels("sim-model"))
    metrics = by_name(otlp.collect())  # type: ignore[arg-type]
    (flying,) = metrics["tokenprobe.requests.in_flight"].data.data_points
    (duration,) = metrics["gen_ai.client.inference.duration"].data.data_points
    for point in (flying, duration):
        assert point.attributes["gen_ai.operation.name"] == "transcription"
        assert point.attributes["gen_ai.provider.name"] == "openai"


def test_a_failed_request_without_usage_is_a_per_request_point_of_zero() -> None:
    """The per-request token histograms take every inference operation, failed ones
    included, "or `0` if the response was not received or did not contain token usage"
    (semantic-conventions-genai docs/gen-ai/gen-ai-token-metrics.md @ 066d4a7f), with
    error.type; a count of content chunks stays out (no token count)."""
    otlp = sink(Collecting(), CollectorRegistry())
    failed = measurement(
        error_type=ErrorType.UPSTREAM_UNREACHABLE,
        status_code=502,
        prompt_tokens=None,
        output_tokens=None,
        token_source=TokenSource.NONE,
        ttft=None,
        inter_token_latencies=(),
    )
    chunks = measurement(token_source=TokenSource.CHUNKS, prompt_tokens=None, output_tokens=30)
    for m in (failed, chunks):
        otlp.record(m, Labels("sim-model"))
    metrics = by_name(otlp.collect())  # type: ignore[arg-type]
    for name in ("input_tokens", "output_tokens"):
        (point,) = metrics[f"gen_ai.client.inference.operation.{name}"].data.data_points
        assert (point.count, point.sum) == (1, 0), name
        assert point.attributes["error.type"] == "upstream_unreachable"


def test_a_stream_cut_without_usage_is_an_input_point_of_zero_and_no_output_point() -> None:
    """A stream cut short without usage (its output a count of content chunks) is a failed
    inference operation all the same: an input point of 0 with its error.type, as the
    conventions ask of "each inference operation, including failed ones", "or `0` if the
    response was not received or did not contain token usage" (semantic-conventions-genai
    docs/gen-ai/gen-ai-token-metrics.md @ 066d4a7f). Its output stays out: the chunks are
    no token count, and 0 would say that none came. Before, it had neither point, though
    tokenprobe.requests counted it among the failures."""
    otlp = sink(Collecting(), CollectorRegistry())
    for error in (ErrorType.STREAM_TRUNCATED, ErrorType.CLIENT_CANCELLED):
        cut = measurement(
            error_type=error,
            token_source=TokenSource.CHUNKS,
            prompt_tokens=None,
            output_tokens=12,
            finish_reason="none",
        )
        otlp.record(cut, Labels("sim-model"))
    metrics = by_name(otlp.collect())  # type: ignore[arg-type]
    points = metrics["gen_ai.client.inference.operation.input_tokens"].data.data_points
    found = {p.attributes["error.type"]: (p.count, p.sum) for p in points}
    assert found == {"stream_truncated": (1, 0), "client_cancelled": (1, 0)}
    assert "gen_ai.client.inference.operation.output_tokens" not in metrics


def embedding(**changes: Any) -> Any:
    fields: dict[str, Any] = {
        "endpoint": "/v1/embeddings",
        "stream": False,
        "stream_requested": False,
        "ttft": None,
        "tpot": None,
        "decode_tokens_per_second": None,
        "inter_token_latencies": (),
        "prompt_tokens": 3,
        "output_tokens": None,
        "content_events": 0,
        "finish_reason": "none",
        "raw_finish_reason": None,
    }
    return measurement(**{**fields, **changes})


@pytest.mark.parametrize("endpoint", ["/v1/embeddings", "/pooling", "/api/embed"])
def test_embeddings_have_the_embeddings_instruments_and_no_output(endpoint: str) -> None:
    """gen_ai.operation.name "embeddings" (OpenAI's, vLLM's /pooling, Ollama's /api/embed):
    gen_ai.client.embeddings.duration and .operation.input_tokens, no output metric
    (docs/gen-ai/client-embeddings.md @ 88eccb15); the inference ones stay the inference's."""
    otlp = sink(Collecting(), CollectorRegistry())
    otlp.record(embedding(endpoint=endpoint), Labels("sim-model"))
    otlp.record(embedding(endpoint=endpoint, e2e=0.5, error_type=ErrorType.UPSTREAM_ERROR,
                          status_code=500, prompt_tokens=None), Labels("sim-model"))  # fmt: skip
    metrics = by_name(otlp.collect())  # type: ignore[arg-type]
    duration = metrics["gen_ai.client.embeddings.duration"]
    assert duration.unit == "s" and list(duration.data.data_points[0].explicit_bounds) == list(
        DURATION_BUCKETS
    )
    assert sum(p.count for p in duration.data.data_points) == 2
    (failed,) = [p for p in duration.data.data_points if "error.type" in p.attributes]
    assert failed.attributes["gen_ai.operation.name"] == "embeddings"
    (tokens,) = metrics["gen_ai.client.embeddings.operation.input_tokens"].data.data_points
    assert metrics["gen_ai.client.embeddings.operation.input_tokens"].unit == "{token}"
    assert (tokens.count, tokens.sum) == (1, 3)  # only where the count is known
    assert not [n for n in metrics if n.startswith("gen_ai.client.inference.") and
                n != "gen_ai.client.inference.usage.input_tokens"]  # fmt: skip


def test_non_generative_operations_count_no_output_tokens() -> None:
    """Score, rerank, classify: no convention of their own, so the inference names, but no
    output-token counter or histogram (they generate nothing)."""
    otlp = sink(Collecting(), CollectorRegistry())
    otlp.record(embedding(endpoint="/rerank"), Labels("sim-model"))
    metrics = by_name(otlp.collect())  # type: ignore[arg-type]
    assert "gen_ai.client.inference.duration" in metrics
    assert "gen_ai.client.inference.operation.input_tokens" in metrics
    assert "gen_ai.client.inference.usage.output_tokens" not in metrics
    assert "gen_ai.client.inference.operation.output_tokens" not in metrics


def test_model_attributes_carry_exact_vouched_names_and_the_label_apart() -> None:
    """gen_ai.request.model is the name the client sent and gen_ai.response.model the one
    the backend answered with, each only when the proxy vouches for it; the bounded label
    (`other`, or the one model of a llama-server that serves it whatever a request names)
    is tokenprobe.model, on the in-flight points too. Before, the label went out as
    gen_ai.request.model (`other`, or the served model as if requested)."""
    registry = CollectorRegistry()
    prom = Metrics(registry)
    models = ModelLabels()
    models.update_from_upstream(["qwen.gguf"])
    models.names_ignored(True)  # llama-server: serves qwen.gguf whatever the request names
    otlp = OtlpMetrics(
        Collecting(),
        upstream="http://llama:8080",
        failures=metric_export_failures(registry),
        models=models,
        resource=Resource.create({}),
        in_flight=prom.in_flight,
    )
    prom.in_flight.labels(models("gpt-4"), "/v1/chat/completions").inc()
    # llama-server echoes the request's name as the response's model
    otlp.record(measurement(model="gpt-4", response_model="gpt-4"), Labels(models("gpt-4")))
    named = measurement(model="qwen.gguf", response_model="qwen.gguf", e2e=2.0)
    otlp.record(named, Labels(models("qwen.gguf")))
    metrics = by_name(otlp.collect())  # type: ignore[arg-type]
    duration = metrics["gen_ai.client.inference.duration"].data.data_points
    attributes = {
        (
            p.attributes["tokenprobe.model"],
            p.attributes.get("gen_ai.request.model"),
            p.attributes.get("gen_ai.response.model"),
        )
        for p in duration
    }
    assert attributes == {("qwen.gguf", None, None), ("qwen.gguf", "qwen.gguf", "qwen.gguf")}
    (flying,) = metrics["tokenprobe.requests.in_flight"].data.data_points
    assert flying.attributes["tokenprobe.model"] == "qwen.gguf"
    assert "gen_ai.request.model" not in flying.attributes
