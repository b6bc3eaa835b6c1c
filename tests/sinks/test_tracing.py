"""The tracing sink on its own: in-memory exporter, hand-made requests and records."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import orjson
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry

from proxy.core.apis import api_of
from proxy.core.measurement import NONE_LABEL, ErrorType, Measurement, TokenSource
from proxy.core.request import CHAT, COMPLETIONS, RequestInfo
from proxy.core.upstream_url import UpstreamURL
from proxy.settings import SettingsError
from proxy.sinks.semconv import Names, server_attributes
from proxy.sinks.span_export import CountingBatchProcessor, export_failures
from proxy.sinks.tracing import Tracing, tracing_from_env
from tests.factories import measurement
from tests.servers import free_port

UPSTREAM = "http://vllm.internal:8000"
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01".encode()
STARTED_AT = 1_700_000_000.25


def info(endpoint: str = CHAT, **changes: Any) -> RequestInfo:
    fields: dict[str, Any] = {
        "endpoint": endpoint,
        "model": "sim-model",
        "stream": True,
        "usage_requested": False,
        "max_tokens": 64,
        "temperature": 0.7,
        "prompt": [{"role": "user", "content": "the secret plan is purple"}],
    }
    return RequestInfo(**{**fields, **changes})


def record(**changes: Any) -> Measurement:
    return measurement(
        **{
            "started_at": STARTED_AT,
            "cached_prompt_tokens": 4,
            "response_id": "chatcmpl-123",
            "response_model": "sim-model",
            "max_tokens": 64,
            "temperature": 0.7,
            **changes,
        }
    )


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracing(exporter: InMemorySpanExporter) -> Iterator[Tracing]:
    t = Tracing([SimpleSpanProcessor(exporter)], upstream=UPSTREAM)
    yield t
    t.shutdown()


def traced(
    tracing: Tracing,
    exporter: InMemorySpanExporter,
    request: RequestInfo | None = None,
    measurement: Measurement | None = None,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> tuple[ReadableSpan, str | None, list[tuple[bytes, bytes]]]:
    m = measurement or record()
    span, trace_id, upstream = tracing.start(
        request or info(), headers or [], int(m.started_at * 1e9)
    )
    tracing.finish(span, m)
    (finished,) = exporter.get_finished_spans()
    return finished, trace_id, upstream


# -- the span -----------------------------------------------------------------------------


def test_span_is_a_client_span_named_operation_and_model(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    span, _, _ = traced(tracing, exporter)
    assert span.name == "chat sim-model"
    assert span.kind is SpanKind.CLIENT
    assert span.resource.attributes["service.name"] == "tokenprobe"


def test_completions_are_text_completion_operations(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    span, _, _ = traced(
        tracing, exporter, info(COMPLETIONS, prompt="hi"), record(endpoint=COMPLETIONS)
    )
    assert span.name == "text_completion sim-model"
    assert span.attributes is not None
    assert span.attributes["gen_ai.operation.name"] == "text_completion"


@pytest.mark.parametrize(
    ("endpoint", "operation", "provider"),
    [
        ("/v1/messages", "chat", "anthropic"),
        ("/v1/responses", "chat", "openai"),
        ("/v1/embeddings", "embeddings", "openai"),
        ("/rerank", "rerank", "openai"),
    ],
)
def test_operation_and_provider_come_from_the_api(
    tracing: Tracing, exporter: InMemorySpanExporter, endpoint: str, operation: str, provider: str
) -> None:
    m = record(endpoint=endpoint, finish_reason="length", raw_finish_reason="max_tokens")
    span, _, _ = traced(tracing, exporter, info(endpoint), m)
    attributes = span.attributes or {}
    assert span.name == f"{operation} sim-model"
    assert attributes["gen_ai.operation.name"] == operation
    assert attributes["gen_ai.provider.name"] == provider
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert attributes["tokenprobe.raw_finish_reason"] == "max_tokens"


#: The attributes the current conventions (semantic-conventions-genai ac48b1f9,
#: client-inference.md) added since the previous names, for the default record.
CURRENT_ONLY = {"gen_ai.response.time_to_first_chunk": 0.050}


@pytest.mark.parametrize("previous", [False, True], ids=["current", "previous"])
def test_attributes_follow_the_genai_conventions(
    exporter: InMemorySpanExporter, previous: bool
) -> None:
    names = Names(current=not previous, previous=previous)
    tracing = Tracing([SimpleSpanProcessor(exporter)], upstream=UPSTREAM, names=names)
    span, _, _ = traced(tracing, exporter)
    tracing.shutdown()
    assert dict(span.attributes or {}) == ({} if previous else CURRENT_ONLY) | {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "sim-model",
        "openai.api.type": "chat_completions",
        "gen_ai.request.stream": True,
        "gen_ai.request.max_tokens": 64,
        "gen_ai.request.temperature": 0.7,
        "gen_ai.response.id": "chatcmpl-123",
        "gen_ai.response.model": "sim-model",
        "gen_ai.response.finish_reasons": ("stop",),
        "gen_ai.usage.input_tokens": 12,
        "gen_ai.usage.output_tokens": 16,
        "gen_ai.usage.cache_read.input_tokens": 4,
        "server.address": "vllm.internal",
        "server.port": 8000,
        "http.response.status_code": 200,
        "tokenprobe.time_to_first_byte": 0.010,
        "tokenprobe.time_to_first_token": 0.050,
        "tokenprobe.time_per_output_token": 0.005,
        "tokenprobe.decode_tokens_per_second": 200.0,
        "tokenprobe.output_tokens_per_chunk": 1.0,
        "tokenprobe.e2e": 0.125,
        "tokenprobe.token_source": "usage",
    }
    assert span.status.status_code is StatusCode.UNSET


#: The span's cache writes by name set: current (semantic-conventions-genai ac48b1f9,
#: client-inference.md) and previous (004902b8, gen-ai-spans.md).
CACHE_WRITE = "gen_ai.usage.cache_write.input_tokens"
CACHE_CREATION = "gen_ai.usage.cache_creation.input_tokens"


@pytest.mark.parametrize(
    ("names", "keys"),
    [
        (Names(), (CACHE_WRITE,)),
        (Names(current=False, previous=True), (CACHE_CREATION,)),
        (Names(current=True, previous=True), (CACHE_WRITE, CACHE_CREATION)),
    ],
    ids=["current", "previous", "both"],
)
def test_cache_writes_go_by_each_name_set_s_own_attribute(
    exporter: InMemorySpanExporter, names: Names, keys: tuple[str, ...]
) -> None:
    tracing = Tracing([SimpleSpanProcessor(exporter)], upstream=UPSTREAM, names=names)
    span, _, _ = traced(tracing, exporter, measurement=record(cache_write_tokens=128))
    attributes = dict(span.attributes or {})
    assert {k: attributes[k] for k in (CACHE_WRITE, CACHE_CREATION) if k in attributes} == (
        dict.fromkeys(keys, 128)
    )
    exporter.clear()
    unsaid, _, _ = traced(tracing, exporter)  # the backend said nothing: no attribute
    tracing.shutdown()
    assert not {CACHE_WRITE, CACHE_CREATION} & set(unsaid.attributes or {})


def test_the_system_fingerprint_is_on_openai_spans_only(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    m = record(system_fingerprint="vllm-0.32.0-51eb094b")
    span, _, _ = traced(tracing, exporter, measurement=m)
    assert (span.attributes or {})["openai.response.system_fingerprint"] == "vllm-0.32.0-51eb094b"
    exporter.clear()
    messages = replace(m, endpoint="/v1/messages")  # gen_ai.provider.name anthropic
    span, _, _ = traced(tracing, exporter, info("/v1/messages"), messages)
    assert "openai.response.system_fingerprint" not in (span.attributes or {})
    exporter.clear()
    plain, _, _ = traced(tracing, exporter)
    assert "openai.response.system_fingerprint" not in (plain.attributes or {})


def test_content_chunks_counted_for_want_of_tokens_are_no_token_usage(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    # No usage and no tokenizer: the count is of content events, which the conventions'
    # gen_ai.usage.output_tokens does not take (as the OTLP usage metrics leave it out).
    m = record(token_source=TokenSource.CHUNKS, output_tokens=3, content_events=3)
    span, _, _ = traced(tracing, exporter, measurement=m)
    attributes = dict(span.attributes or {})
    assert "gen_ai.usage.output_tokens" not in attributes
    assert attributes["tokenprobe.output_chunks"] == 3
    assert attributes["tokenprobe.token_source"] == "chunks"


def test_reasoning_tokens_come_from_the_record_once_it_has_them(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    later = record(reasoning_tokens=7, reasoning_token_source="usage")
    span, _, _ = traced(tracing, exporter, measurement=later)
    assert (span.attributes or {})["gen_ai.usage.reasoning.output_tokens"] == 7
    exporter.clear()
    plain, _, _ = traced(tracing, exporter)
    assert "gen_ai.usage.reasoning.output_tokens" not in (plain.attributes or {})


@pytest.mark.parametrize("previous", [False, True], ids=["current", "previous"])
def test_previous_response_id_is_the_request_s_previous_response_attribute(
    exporter: InMemorySpanExporter, previous: bool
) -> None:
    """gen_ai.request.previous_response.id (semantic-conventions-genai
    docs/gen-ai/client-inference.md at ac48b1f9): the Responses request's
    previous_response_id as sent, with the current names only; an id longer than any
    backend's is not traced."""
    names = Names(current=not previous, previous=previous)
    tracing = Tracing([SimpleSpanProcessor(exporter)], upstream=UPSTREAM, names=names)
    request = info("/v1/responses", previous_response_id="resp_0123456789aBCdef")
    span, _, _ = traced(tracing, exporter, request=request)
    attributes = dict(span.attributes or {})
    if previous:
        assert "gen_ai.request.previous_response.id" not in attributes
    else:
        assert attributes["gen_ai.request.previous_response.id"] == "resp_0123456789aBCdef"
    exporter.clear()
    huge = info("/v1/responses", previous_response_id="resp_" + "x" * 300)
    span, _, _ = traced(tracing, exporter, request=huge)
    tracing.shutdown()
    assert "gen_ai.request.previous_response.id" not in (span.attributes or {})


@pytest.mark.parametrize(
    ("finish_reasons", "expected"),
    [
        ((), ("stop",)),  # one choice, cut after it finished: its reason, error.type apart
        (("stop", "length"), ("stop", "length")),  # n = 2: one position each, in order
        (("stop", "none"), ("stop", "error")),  # the second never finished
    ],
)
def test_finish_reasons_have_one_position_per_choice(
    tracing: Tracing,
    exporter: InMemorySpanExporter,
    finish_reasons: tuple[str, ...],
    expected: tuple[str, ...],
) -> None:
    """ "Each position SHOULD contain the finish reason for the corresponding choice"
    (docs/gen-ai/client-inference.md @ ac48b1f9, note 18): a single choice cut short after
    its finish once got a second position, "error"."""
    cut = record(
        error_type=ErrorType.CLIENT_CANCELLED, finish_reason="stop", finish_reasons=finish_reasons
    )
    span, _, _ = traced(tracing, exporter, measurement=cut)
    attributes = span.attributes or {}
    assert attributes["gen_ai.response.finish_reasons"] == expected
    assert attributes["error.type"] == "client_cancelled"


def test_non_streaming_request_has_no_stream_attribute(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    span, _, _ = traced(tracing, exporter, info(stream=False), record(stream=False, ttft=None))
    assert "gen_ai.request.stream" not in (span.attributes or {})
    assert "tokenprobe.time_to_first_token" not in (span.attributes or {})


def test_span_runs_from_request_start_for_e2e_with_events_at_their_instants(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    span, _, _ = traced(tracing, exporter)
    start = int(STARTED_AT * 1e9)
    assert span.start_time == start
    assert span.end_time == start + 125_000_000
    assert [(e.name, e.timestamp) for e in span.events] == [
        ("first_byte", start + 10_000_000),
        ("first_token", start + 50_000_000),
    ]


def test_error_sets_error_type_status_and_error_finish_reason(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    m = record(
        status_code=504,
        ttft=None,
        tpot=None,
        decode_tokens_per_second=None,
        finish_reason=NONE_LABEL,
        error_type=ErrorType.UPSTREAM_TIMEOUT,
        error_message="no response headers within 600s",
    )
    span, _, _ = traced(tracing, exporter, measurement=m)
    attributes = span.attributes or {}
    assert attributes["error.type"] == "upstream_timeout"
    assert attributes["gen_ai.response.finish_reasons"] == ("error",)
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "no response headers within 600s"
    assert [e.name for e in span.events] == ["first_byte"]


def test_a_failed_measurement_still_ends_the_span_as_an_error(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    span, _, _ = tracing.start(info(), [])
    tracing.finish(span, None)
    (finished,) = exporter.get_finished_spans()
    assert finished.status.status_code is StatusCode.ERROR


# -- propagation --------------------------------------------------------------------------


def test_client_traceparent_makes_the_proxy_span_its_child(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    headers = [(b"traceparent", CLIENT_TRACEPARENT), (b"tracestate", b"vendor=abc")]
    span, trace_id, _ = traced(tracing, exporter, headers=headers)
    assert format(span.context.trace_id, "032x") == CLIENT_TRACE == trace_id
    assert span.parent is not None and format(span.parent.span_id, "016x") == CLIENT_SPAN
    assert span.parent.is_remote
    assert span.context.trace_state.to_header() == "vendor=abc"


def test_upstream_traceparent_names_the_proxy_span(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    headers = [(b"traceparent", CLIENT_TRACEPARENT), (b"tracestate", b"vendor=abc")]
    span, _, upstream = traced(tracing, exporter, headers=headers)
    sent = dict(upstream)
    ctx = span.context
    assert sent[b"traceparent"] == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-01".encode()
    assert sent[b"tracestate"] == b"vendor=abc"


def test_without_a_client_traceparent_the_span_is_a_root(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    span, trace_id, upstream = traced(tracing, exporter)
    assert span.parent is None
    assert trace_id == format(span.context.trace_id, "032x")
    assert dict(upstream)[b"traceparent"].startswith(f"00-{trace_id}-".encode())


def test_malformed_traceparent_starts_a_new_trace(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    span, _, _ = traced(tracing, exporter, headers=[(b"traceparent", b"00-nonsense-01")])
    assert span.parent is None


def test_unsampled_request_has_no_trace_id_but_still_propagates(
    exporter: InMemorySpanExporter,
) -> None:
    tracing = Tracing(
        [SimpleSpanProcessor(exporter)], upstream=UPSTREAM, sampler=ParentBased(ALWAYS_OFF)
    )
    span, trace_id, upstream = tracing.start(info(), [])
    tracing.finish(span, record())
    assert trace_id is None
    assert exporter.get_finished_spans() == ()
    flags = int(dict(upstream)[b"traceparent"].rsplit(b"-", 1)[1], 16)
    assert flags & 0x01 == 0  # the sampled bit


# -- privacy ------------------------------------------------------------------------------


def _all_text(span: ReadableSpan) -> str:
    values = [str(v) for v in (span.attributes or {}).values()]
    values += [str(v) for e in span.events for v in (e.attributes or {}).values()]
    return " ".join([span.name, *values])


def test_prompt_text_is_not_traced_by_default(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    span, _, _ = traced(tracing, exporter)
    assert "purple" not in _all_text(span)
    assert "gen_ai.input.messages" not in (span.attributes or {})


def test_trace_content_puts_the_prompt_in_input_messages(exporter: InMemorySpanExporter) -> None:
    tracing = Tracing([SimpleSpanProcessor(exporter)], upstream=UPSTREAM, trace_content=True)
    span, _, _ = traced(tracing, exporter)
    assert (span.attributes or {})["gen_ai.input.messages"] == (
        '[{"role":"user","parts":[{"type":"text","content":"the secret plan is purple"}]}]'
    )


@pytest.mark.parametrize(
    ("endpoint", "prompt", "want"),
    [
        # Completions' seam reads its text prompt (or a batch) as one user message per text.
        (COMPLETIONS, ["one", "two"], '[{"role":"user","parts":[{"type":"text","content":"one"}]},'
         '{"role":"user","parts":[{"type":"text","content":"two"}]}]'),
        (COMPLETIONS, [1, 2, 3], None),  # token ids: nothing to show
        # The chat-like default: parts by type, no media payloads.
        (CHAT, [{"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "image_url", "image_url": "data:x"}]}],
         '[{"role":"user","parts":[{"type":"text","content":"a"},{"type":"image_url"}]}]'),
        (CHAT, "not a list", None),
    ],
)  # fmt: skip
def test_each_seam_says_how_its_prompt_becomes_input_messages(
    exporter: InMemorySpanExporter, endpoint: str, prompt: object, want: str | None
) -> None:
    tracing = Tracing([SimpleSpanProcessor(exporter)], upstream=UPSTREAM, trace_content=True)
    span, _, _ = traced(tracing, exporter, info(endpoint, prompt=prompt), record(endpoint=endpoint))
    assert (span.attributes or {}).get("gen_ai.input.messages") == want


def test_header_values_never_reach_the_span(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    headers = [
        (b"authorization", b"Bearer sk-SECRET123"),
        (b"api-key", b"SECRET123"),
        (b"cookie", b"session=SECRET123"),
        (b"traceparent", CLIENT_TRACEPARENT),
    ]
    span, _, upstream = traced(tracing, exporter, headers=headers)
    assert "SECRET123" not in _all_text(span)
    assert {name for name, _ in upstream} == {b"traceparent"}


# -- configuration from the environment ---------------------------------------------------


@pytest.mark.parametrize(
    "environ",
    [
        {},
        {"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"},
        {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"},
        {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "  "},
    ],
)
def test_tracing_is_off_unless_otel_variables_ask_for_it(environ: dict[str, str]) -> None:
    assert tracing_from_env(environ, upstream=UPSTREAM, registry=CollectorRegistry()) is None


def test_endpoint_turns_tracing_on_with_otel_settings() -> None:
    environ = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces",
        "OTEL_SERVICE_NAME": "edge-proxy",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
    }
    tracing = tracing_from_env(environ, upstream=UPSTREAM, registry=CollectorRegistry())
    assert tracing is not None
    try:
        assert tracing.provider.resource.attributes["service.name"] == "edge-proxy"
        sampler = tracing.provider.sampler
        assert isinstance(sampler, ParentBased)
        assert isinstance(sampler._root, TraceIdRatioBased) and sampler._root.rate == 0.25
    finally:
        tracing.shutdown()


def test_grpc_protocol_is_supported() -> None:
    environ = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
    }
    tracing = tracing_from_env(environ, upstream=UPSTREAM, registry=CollectorRegistry())
    assert tracing is not None
    tracing.shutdown()


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
        ("OTEL_TRACES_SAMPLER", "sometimes"),
        ("OTEL_TRACES_EXPORTER", "zipkin"),
        ("OTEL_BSP_MAX_QUEUE_SIZE", "lots"),
    ],
)
def test_unusable_otel_value_fails_naming_the_variable(variable: str, value: str) -> None:
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", variable: value}
    with pytest.raises(SettingsError, match=variable):
        tracing_from_env(environ, upstream=UPSTREAM, registry=CollectorRegistry())


# -- losing spans, counted ----------------------------------------------------------------


@pytest.mark.quiet("a timing read within tens of milliseconds")
def test_dead_collector_never_raises_into_finish_and_is_counted() -> None:
    registry = CollectorRegistry()
    environ = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}",  # nothing listens
        "OTEL_EXPORTER_OTLP_TIMEOUT": "0.5",
    }
    tracing = tracing_from_env(environ, upstream=UPSTREAM, registry=registry)
    assert tracing is not None
    try:
        began = time.monotonic()
        span, _, _ = tracing.start(info(), [])
        tracing.finish(span, record())
        assert time.monotonic() - began < 0.1  # finish only queues the span
        tracing.force_flush()
        lost = registry.get_sample_value(
            "tokenprobe_trace_export_failures_total", {"reason": "export"}
        )
        assert lost == 1.0
    finally:
        tracing.shutdown()


class _GatedExporter(SpanExporter):
    """Holds its first export until released, like a collector that hangs."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.exported = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.entered.set()
        self.release.wait(10)
        self.exported += len(spans)
        return SpanExportResult.SUCCESS


def test_spans_dropped_by_a_full_queue_are_counted() -> None:
    registry = CollectorRegistry()
    gated = _GatedExporter()
    processor = CountingBatchProcessor(
        gated,
        export_failures(registry),
        max_queue_size=2,
        max_export_batch_size=2,
        schedule_delay_millis=60_000,
    )
    tracing = Tracing([processor], upstream=UPSTREAM)

    def one() -> None:
        span, _, _ = tracing.start(info(), [])
        tracing.finish(span, record())

    one()
    one()  # a full batch: the worker takes both and hangs in export
    assert gated.entered.wait(5)
    for _ in range(4):  # two fit in the queue, two push out the oldest
        one()
    gated.release.set()
    tracing.force_flush()
    dropped = registry.get_sample_value(
        "tokenprobe_trace_export_failures_total", {"reason": "queue_full"}
    )
    assert (dropped, gated.exported) == (2.0, 4)
    tracing.shutdown()


@pytest.mark.parametrize(
    ("upstream", "address", "port"),
    [
        ("https://gateway.example/tenant-a/", "gateway.example", 443),  # default port, base path
        ("http://[::1]:8001/v", "::1", 8001),  # IPv6 without its brackets
        ("HTTP://Vllm.Internal", "vllm.internal", 80),
    ],
)
def test_spans_and_otlp_name_the_server_as_the_data_paths_reach_it(
    exporter: InMemorySpanExporter, upstream: str, address: str, port: int
) -> None:
    """server.* come from proxy/core/upstream_url.py, the parse the wire, the ASGI relay
    and the tunnel connect with (issue 31), for the spans and the OTLP metrics alike."""
    where = UpstreamURL.parse(upstream)
    assert (where.host, where.port) == (address, port)
    assert server_attributes(upstream) == (("server.address", address), ("server.port", port))
    tracing = Tracing([SimpleSpanProcessor(exporter)], upstream=upstream)
    span, _, _ = traced(tracing, exporter)
    tracing.shutdown()
    attributes = span.attributes or {}
    assert (attributes["server.address"], attributes["server.port"]) == (address, port)


# -- the request's options and content, read by each seam ------------------------------------


def read(endpoint: str, body: dict[str, Any]) -> RequestInfo:
    return api_of(endpoint).read_request({"model": "sim-model", **body})


def started(tracing: Tracing, exporter: InMemorySpanExporter, request: RequestInfo) -> Any:
    span, _, _ = traced(tracing, exporter, request, record(endpoint=request.endpoint))
    return span.attributes or {}


@pytest.mark.parametrize(
    ("endpoint", "body", "want"),
    [
        (CHAT, {"messages": [], "seed": "7", "n": 2, "top_p": 0.9, "top_k": 40,
                "frequency_penalty": 0.5, "presence_penalty": -0.5, "stop": "END",
                "response_format": {"type": "json_schema", "json_schema": {}}},
         {"seed": 7, "choice.count": 2, "top_p": 0.9, "top_k": 40, "frequency_penalty": 0.5,
          "presence_penalty": -0.5, "stop_sequences": ("END",), "output.type": "json"}),
        (COMPLETIONS, {"prompt": "x", "n": 1, "stop": ["a", "b"],
                       "response_format": {"type": "text"}},
         {"stop_sequences": ("a", "b"), "output.type": "text"}),  # n 1: no choice.count
        # Anthropic's names; its API has no seed, n, penalties or response_format
        ("/v1/messages", {"messages": [], "stop_sequences": ["\n\nHuman:"], "top_k": 5,
                          "top_p": 0.5, "seed": 3, "n": 2, "stop": ["x"]},
         {"stop_sequences": ("\n\nHuman:",), "top_k": 5, "top_p": 0.5}),
        # Responses: text.format, and no `n`
        ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_object"}},
                           "top_p": 0.25, "seed": 9, "n": 3},
         {"output.type": "json", "top_p": 0.25, "seed": 9}),
        ("/v1/embeddings", {"input": "hi", "encoding_format": "base64", "dimensions": 256,
                            "seed": 1},
         {"encoding_formats": ("base64",), "dimension.count": 256}),
        (CHAT, {"messages": [], "seed": "x", "top_p": "nan", "stop": [1]}, {}),  # refused
    ],
)  # fmt: skip
def test_the_request_s_sampling_and_output_options_are_span_attributes(
    tracing: Tracing, exporter: InMemorySpanExporter, endpoint: str, body: Any, want: Any
) -> None:
    attributes = started(tracing, exporter, read(endpoint, body))
    options = ("seed", "choice.count", "top_p", "top_k", "frequency_penalty", "presence_penalty",
               "stop_sequences", "encoding_formats")  # fmt: skip
    names = [f"gen_ai.request.{o}" for o in options]
    names += ["gen_ai.output.type", "gen_ai.embeddings.dimension.count"]
    got = {n.removeprefix("gen_ai.request.").removeprefix("gen_ai.").removeprefix(
        "embeddings."): attributes[n] for n in names if n in attributes}  # fmt: skip
    assert got == want


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        ("/v1/messages", {"system": "be brief", "messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/messages", {"system": [{"type": "text", "text": "be brief"}],
                          "messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/responses", {"instructions": "be brief", "input": "hi"}),
    ],
)  # fmt: skip
def test_separate_system_instructions_are_system_instructions_not_a_message(
    exporter: InMemorySpanExporter, endpoint: str, body: Any
) -> None:
    """Anthropic `system` and Responses `instructions` are gen_ai.system_instructions
    (docs/gen-ai/client-inference.md @ 024a4f94, note 38); the prompt the tokenizer and the
    fingerprint read still begins with them."""
    tracing = Tracing([SimpleSpanProcessor(exporter)], upstream=UPSTREAM, trace_content=True)
    request = read(endpoint, body)
    assert request.prompt[0] == {"role": "system", "content": "be brief"}
    attributes = started(tracing, exporter, request)
    assert attributes["gen_ai.system_instructions"] == '[{"type":"text","content":"be brief"}]'
    assert attributes["gen_ai.input.messages"] == (
        '[{"role":"user","parts":[{"type":"text","content":"hi"}]}]'
    )


def test_system_instructions_are_content_and_not_traced_by_default(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    request = read("/v1/messages", {"system": "purple", "messages": []})
    attributes = started(tracing, exporter, request)
    assert "gen_ai.system_instructions" not in attributes
    assert "purple" not in str(attributes)


@pytest.mark.parametrize(
    ("endpoint", "body", "want"),
    [
        (CHAT, {"messages": [
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "rainy"}]},
         [{"role": "assistant", "parts": [{"type": "tool_call", "id": "call_1",
                                           "name": "get_weather",
                                           "arguments": '{"city":"Paris"}'}]},
          {"role": "tool", "parts": [{"type": "tool_call_response", "id": "call_1",
                                      "response": "rainy"}]}]),
        ("/v1/messages", {"messages": [
            {"role": "assistant", "content": [
                {"type": "text", "text": "let me look"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "rainy"}]}]}]},
         [{"role": "assistant", "parts": [{"type": "text", "content": "let me look"},
                                          {"type": "tool_call", "id": "toolu_1",
                                           "name": "get_weather",
                                           "arguments": {"city": "Paris"}}]},
          {"role": "user", "parts": [{"type": "tool_call_response", "id": "toolu_1",
                                      "response": "rainy"}]}]),
        ("/v1/responses", {"input": [
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "done"}]},
         [{"role": "assistant", "parts": [{"type": "tool_call", "id": "c1", "name": "f",
                                           "arguments": "{}"}]},
          {"role": "tool", "parts": [{"type": "tool_call_response", "id": "c1",
                                      "response": "done"}]}]),
    ],
)  # fmt: skip
def test_tool_calls_and_their_results_are_input_message_parts(
    exporter: InMemorySpanExporter, endpoint: str, body: Any, want: Any
) -> None:
    """gen-ai-input-messages.json @ b49cb9d3: ToolCallRequestPart {type tool_call, id, name,
    arguments}, ToolCallResponsePart {type tool_call_response, id, response}."""
    tracing = Tracing([SimpleSpanProcessor(exporter)], upstream=UPSTREAM, trace_content=True)
    attributes = started(tracing, exporter, read(endpoint, body))
    assert orjson.loads(attributes["gen_ai.input.messages"]) == want
