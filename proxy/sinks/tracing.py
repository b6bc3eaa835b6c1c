"""The OpenTelemetry sink: one CLIENT span per measured request, exported in the background.

The span follows the GenAI client-inference conventions (span `gen_ai.client.inference`,
named `{operation} {model}`, `gen_ai.*` attributes; pinned in proxy/sinks/semconv.py:
open-telemetry/semantic-conventions-genai docs/gen-ai/client-inference.md at ac48b1f9)
and adds the proxy's own measurements as `tokenprobe.*`
attributes (seconds) and two events, `first_byte` and `first_token`, at their instants.
The request's sampling options (gen_ai.request.*) are set at the span's start, from
RequestInfo. No event per chunk. Prompt text (gen_ai.input.messages,
gen_ai.system_instructions) only with `trace_content`; header values never, except
the W3C `traceparent`/`tracestate` a client sends, which the span joins.

Off by default: `tracing_from_env` returns None unless the standard OTEL_* variables ask
for traces (read in proxy/sinks/otel_env.py), and then the proxy does no tracing work at
all. When on, spans are exported in the background and their losses counted
(proxy/sinks/span_export.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry

from proxy.core.apis import Api, RequestInfo
from proxy.core.apis.base import gen_ai_message
from proxy.core.conversations import MAX_RESPONSE_ID
from proxy.core.errors import shown_model
from proxy.core.lenient_json import without_surrogates
from proxy.core.measurement import NONE_LABEL, Measurement, TokenSource
from proxy.core.wsseam import seam_of
from proxy.settings import SettingsError
from proxy.sinks import otel_env, semconv
from proxy.sinks.span_export import CountingBatchProcessor, export_failures, otlp_span_exporter

Headers = list[tuple[bytes, bytes]]


_PROPAGATOR = TraceContextTextMapPropagator()
_TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})


class Tracing:
    """The RequestTracer: opens a span when a request starts, fills and ends it at the end."""

    def __init__(
        self,
        processors: Sequence[SpanProcessor],
        *,
        upstream: str,
        sampler: Sampler | None = None,
        service_name: str = "tokenprobe",
        trace_content: bool = False,
        names: semconv.Names = semconv.DEFAULT,
    ) -> None:
        self.names = names
        # The OTLP metrics' schema URL on the spans' resource and scope too (proxy/sinks/
        # semconv.py says why that one). Set on the resource made, not passed to `create`:
        # there a detector with a schema URL of its own (a third-party one named in
        # OTEL_EXPERIMENTAL_RESOURCE_DETECTORS) would fail the merge (`Resource.merge`
        # keeps the old resource then), and the service name would be lost.
        created = Resource.create({"service.name": service_name})
        # Its own provider: the process-wide global one stays whatever the host app set.
        self.provider = TracerProvider(
            sampler=sampler or ParentBased(ALWAYS_ON),
            resource=Resource(created.attributes, semconv.SCHEMA_URL),
        )
        for processor in processors:
            self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("tokenprobe", schema_url=semconv.SCHEMA_URL)
        self.trace_content = trace_content
        self.server = dict(semconv.server_attributes(upstream))

    def start(
        self, info: RequestInfo, headers: Headers, start_time_ns: int | None = None
    ) -> tuple[Span, str | None, Headers]:
        carrier = {k.decode(): v.decode("latin-1") for k, v in headers if k in _TRACE_HEADERS}
        # An explicit empty context: without a client traceparent the span is a root,
        # whatever happens to be current on this task.
        parent = _PROPAGATOR.extract(carrier, context=Context()) if carrier else Context()
        # An HTTP API's, or a WebSocket API's for a record a session made (a realtime
        # utterance: proxy/sinks/dispatch.py `Sinks.record`), which has no body to trace.
        api = seam_of(info.endpoint)
        operation = api.operation
        model = shown_model(info.model)
        attributes: dict[str, Any] = {
            **dict(semconv.operation_attributes(info.endpoint)),
            **self.server,
        }
        if model:
            attributes["gen_ai.request.model"] = model
        if (api_type := semconv.openai_api_type(api)) is not None:
            attributes["openai.api.type"] = api_type
        if info.stream:
            attributes["gen_ai.request.stream"] = True  # unset means not streaming
        if info.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = info.max_tokens
        if info.temperature is not None:
            attributes["gen_ai.request.temperature"] = info.temperature
        attributes.update(_request_options(info))
        previous = info.previous_response_id
        if previous and self.names.current and len(previous) <= MAX_RESPONSE_ID:
            # The Responses API's previous_response_id: an id the backend gave out, no
            # secret (semantic-conventions-genai docs/gen-ai/client-inference.md at
            # ac48b1f9, Recommended). Longer than any backend's ids: not traced.
            attributes["gen_ai.request.previous_response.id"] = previous
        if self.trace_content and isinstance(api, Api):
            attributes.update(_content(info, api.input_messages(info.prompt)))
        attributes = _encodable(attributes)
        span = self.tracer.start_span(
            without_surrogates(f"{operation} {model}") if model else operation,
            context=parent,
            kind=SpanKind.CLIENT,
            attributes=attributes,
            start_time=start_time_ns,
        )
        out: dict[str, str] = {}
        _PROPAGATOR.inject(out, context=set_span_in_context(span))
        upstream = [(k.encode(), v.encode("latin-1")) for k, v in out.items()]
        ctx = span.get_span_context()
        trace_id = format(ctx.trace_id, "032x") if ctx.trace_flags.sampled else None
        return span, trace_id, upstream

    def finish(self, span: Span, measurement: Measurement | None) -> None:
        if not span.is_recording():
            span.end()
            return
        m = measurement
        if m is None:
            span.set_status(Status(StatusCode.ERROR, "measuring the request failed"))
            span.end()
            return
        start_ns = int(m.started_at * 1e9)
        names = self.names
        attributes = _finish_attributes(m, current=names.current, previous=names.previous)
        span.set_attributes(_encodable(attributes))
        if m.ttfb is not None:
            span.add_event("first_byte", timestamp=start_ns + int(m.ttfb * 1e9))
        if m.ttft is not None:
            span.add_event("first_token", timestamp=start_ns + int(m.ttft * 1e9))
        if m.first_answer is not None and m.first_answer != m.ttft:  # it reasoned or called
            span.add_event("first_answer_token", timestamp=start_ns + int(m.first_answer * 1e9))
        if m.error_type is not None:
            reason = without_surrogates(m.error_message or m.error_type.value)
            span.set_status(Status(StatusCode.ERROR, reason))
        span.end(end_time=start_ns + int(m.e2e * 1e9))

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self.provider.force_flush(timeout_millis)

    def shutdown(self) -> None:
        """Export what is queued (bounded by the exporter's timeout) and stop. Blocking."""
        self.provider.shutdown()


def _encodable(attributes: dict[str, Any]) -> dict[str, Any]:
    """The attributes OTLP can carry. An integer beyond 64 bits (a client's `seed` of
    2**64 - 1, which JSON allows, or a backend's count) is left out here, for the OTLP
    encoder logs a traceback for each such attribute ("Value out of range") before it
    leaves it out: one a request, as many as a client likes. A string with a lone
    surrogate, which no UTF-8 encoder takes, has it replaced (U+FFFD): request bodies read
    leniently are cleaned where they are read (proxy/core/lenient_json.py
    `python_json_object`), this guards any other string not read by orjson. Left as it
    is, the encoder logs a traceback and leaves the attribute out; in a span's name or
    status it fails the whole batch, other requests' spans with it. Cheap: a str's
    `isascii` is O(1)."""
    if not any(_unencodable(v) for v in attributes.values()):
        return attributes
    return {
        k: _clean(v)
        for k, v in attributes.items()
        if not (type(v) is int and not _INT64_MIN <= v <= _INT64_MAX)
    }


def _unencodable(value: object) -> bool:
    if type(value) is int:
        return not _INT64_MIN <= value <= _INT64_MAX
    if type(value) is str:
        return without_surrogates(value) is not value
    if isinstance(value, (list, tuple)):
        return any(type(v) is str and without_surrogates(v) is not v for v in value)
    return False


def _clean(value: object) -> object:
    if type(value) is str:
        return without_surrogates(value)
    if isinstance(value, (list, tuple)):
        return [without_surrogates(v) if type(v) is str else v for v in value]
    return value


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _request_options(info: RequestInfo) -> dict[str, Any]:
    """The request's sampling and output options it names, as the span's attributes
    (semantic-conventions-genai docs/gen-ai/client-inference.md @ 024a4f94: seed,
    choice.count "if available, in the request, and !=1", top_k and output.type
    Conditionally Required, the rest Recommended; docs/gen-ai/client-embeddings.md @
    88eccb15: encoding_formats and dimension.count Recommended)."""
    o = info.options
    if o is None:
        return {}
    options = {
        "gen_ai.request.seed": o.seed,
        "gen_ai.request.choice.count": o.choices if o.choices != 1 else None,
        "gen_ai.request.top_p": o.top_p,
        "gen_ai.request.top_k": o.top_k,
        "gen_ai.request.frequency_penalty": o.frequency_penalty,
        "gen_ai.request.presence_penalty": o.presence_penalty,
        "gen_ai.request.stop_sequences": o.stop_sequences,
        "gen_ai.output.type": o.output_type,
        "gen_ai.request.encoding_formats": o.encoding_formats,
        "gen_ai.embeddings.dimension.count": o.dimensions,
    }
    return {k: v for k, v in options.items() if v is not None}


def _content(info: RequestInfo, messages: list[dict[str, Any]] | None) -> dict[str, str]:
    """The prompt as gen_ai.input.messages, and the system instructions a request supplies
    apart from its messages (Anthropic `system`, Responses `instructions`) as
    gen_ai.system_instructions, which "SHOULD be used when the corresponding provider or
    API allows to provide system instructions or messages separately from the chat
    history" (docs/gen-ai/client-inference.md @ 024a4f94, note 38). RequestInfo.prompt
    begins with them as a system message wherever it had messages to put them before (for
    the tokenizer and the conversation fingerprint): that message is left out here."""
    attributes: dict[str, str] = {}
    if info.system is not None:
        parts = gen_ai_message({"content": info.system})["parts"]
        attributes["gen_ai.system_instructions"] = orjson.dumps(parts).decode()
        if messages and messages[0]["role"] == "system":
            messages = messages[1:]
    if messages is not None:
        attributes["gen_ai.input.messages"] = orjson.dumps(messages).decode()
    return attributes


def _finish_attributes(
    m: Measurement, *, current: bool = True, previous: bool = False
) -> dict[str, Any]:
    """The attributes known once the request ended. `current`: also those the current
    conventions added (ac48b1f9): time to first chunk, reasoning tokens, and "error" among the finish reasons of a stream cut short after one.
    The cache writes go by each set's own name (`current`, `previous`: both with
    gen_ai_previous/dup)."""
    chunks = m.token_source is TokenSource.CHUNKS
    attributes: dict[str, Any] = {
        "tokenprobe.e2e": m.e2e,
        "tokenprobe.token_source": m.token_source.value,
    }
    optional: dict[str, Any] = {
        "gen_ai.response.id": m.response_id,
        "gen_ai.response.model": m.response_model,
        "gen_ai.usage.input_tokens": m.prompt_tokens,
        # A count of content chunks (no usage, no tokenizer) is no token count: the OTLP
        # metrics leave it out of usage too (proxy/sinks/otlp/sink.py `_output_tokens`).
        "gen_ai.usage.output_tokens": None if chunks else m.output_tokens,
        "tokenprobe.output_chunks": m.output_tokens if chunks else None,
        "gen_ai.usage.cache_read.input_tokens": m.cached_prompt_tokens,
        # Prompt tokens written to the prefix cache: `gen_ai.usage.cache_write.input_tokens`
        # at ac48b1f9 (docs/gen-ai/client-inference.md, Recommended "when applicable"),
        # `gen_ai.usage.cache_creation.input_tokens` at 004902b8 (gen-ai-spans.md).
        "gen_ai.usage.cache_write.input_tokens": m.cache_write_tokens if current else None,
        "gen_ai.usage.cache_creation.input_tokens": m.cache_write_tokens if previous else None,
        "openai.response.system_fingerprint": semconv.system_fingerprint(m),
        "http.response.status_code": m.status_code or None,
        "error.type": m.error_type.value if m.error_type is not None else None,
        "tokenprobe.time_to_first_byte": m.ttfb,
        "tokenprobe.time_to_first_token": m.ttft,
        "tokenprobe.time_per_output_token": m.tpot,
        "tokenprobe.decode_tokens_per_second": m.decode_tokens_per_second,
        "tokenprobe.proxy_overhead": m.proxy_overhead,
        "tokenprobe.output_tokens_per_chunk": m.output_tokens_per_chunk(),
        # issue 26: where the reasoning count came from (the count itself is
        # gen_ai.usage.reasoning.output_tokens, below), the first tokens by kind
        "tokenprobe.reasoning_token_source": m.reasoning_token_source,
        "tokenprobe.time_to_first_answer_token": m.first_answer,
        "tokenprobe.time_to_first_reasoning_token": m.first_reasoning,
        "tokenprobe.reasoning_duration": m.reasoning_duration,
        "tokenprobe.time_to_first_tool_call": m.first_tool_call,
        "tokenprobe.without_answer": m.without_answer,
        # OpenTelemetry GenAI's conversation id (semantic-conventions-genai), the proxy's
        # keyed hash of the client's conversation header (proxy/core/conversations.py),
        # never the header's value. Only where the client named the conversation: "when no
        # identifier for the conversation is available, instrumentations SHOULD NOT
        # populate conversation id" (docs/gen-ai/client-inference.md @ ac48b1f9, note 5);
        # the id of one the proxy recognised by itself is its own attribute.
        "gen_ai.conversation.id": m.conversation_id if m.conversation_named else None,
        "tokenprobe.conversation.id": m.conversation_id,
        "tokenprobe.conversation.turn": m.turn,
        "tokenprobe.conversation.turn_gap": m.turn_gap,
    }
    for outcome, count in m.tool_call_outcomes().items():
        optional[f"tokenprobe.tool_calls.{outcome}"] = count
    if m.engine is not None:
        queue, engine_ttft, outside = m.ttft_parts()
        spec = m.engine.spec
        optional["tokenprobe.engine.queue_time"] = queue
        optional["tokenprobe.engine.time_to_first_token"] = engine_ttft
        optional["tokenprobe.time_to_first_token_outside_engine"] = outside
        optional["tokenprobe.engine.generation_time"] = m.engine.generation_time
        optional["tokenprobe.engine.load_time"] = m.engine.load_time  # Ollama load_duration
        if spec is not None:
            optional["tokenprobe.engine.spec_decode.draft_tokens"] = spec.draft_tokens
            optional["tokenprobe.engine.spec_decode.accepted_tokens"] = spec.accepted_tokens
            optional["tokenprobe.engine.spec_decode.mean_acceptance_length"] = (
                spec.mean_acceptance_length
            )
    if current:
        optional["gen_ai.response.time_to_first_chunk"] = m.ttft if m.stream else None
        optional["gen_ai.usage.reasoning.output_tokens"] = semconv.reasoning_tokens(m)
    attributes.update((k, v) for k, v in optional.items() if v is not None)
    if m.finish_reason != NONE_LABEL:
        # One position per choice, in index order ("each position SHOULD contain the finish
        # reason for the corresponding choice": docs/gen-ai/client-inference.md @ ac48b1f9,
        # note 18); a choice that never finished is "error", as a request without any is.
        reasons = m.finish_reasons or (m.finish_reason,)
        attributes["gen_ai.response.finish_reasons"] = tuple(
            "error" if r == NONE_LABEL else r for r in reasons
        )
        if m.raw_finish_reason is not None and m.raw_finish_reason != m.finish_reason:
            attributes["tokenprobe.raw_finish_reason"] = m.raw_finish_reason
    elif m.error_type is not None:
        # The conventions: a finish reason expected but not received is reported as "error".
        attributes["gen_ai.response.finish_reasons"] = ("error",)
    return attributes


# -- configured from the standard OTEL_* variables ------------------------------------------


def tracing_from_env(
    environ: Mapping[str, str],
    *,
    upstream: str,
    registry: CollectorRegistry,
    trace_content: bool = False,
) -> Tracing | None:
    """A Tracing configured by OTEL_* variables, or None when they do not ask for traces.

    Traces are on when OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
    is set, or OTEL_TRACES_EXPORTER names an exporter; off when OTEL_TRACES_EXPORTER is
    "none" or OTEL_SDK_DISABLED is true. Raises SettingsError, naming the variable, for a
    value it cannot use.
    """
    env = otel_env.otel_env(environ)
    names = otel_env.exporters(env, "traces")
    if not names:
        return None
    targets = [_target(name, env) for name in names]
    batching = _batching(env)
    sampler = _sampler(env)
    failures = export_failures(registry)
    processors = [
        CountingBatchProcessor(_exporter(target), failures, **batching) for target in targets
    ]
    return Tracing(
        processors,
        upstream=upstream,
        sampler=sampler,
        service_name=otel_env.service_name(env),
        trace_content=trace_content,
        names=semconv.names_from_env(env),
    )


def check_tracing_env(environ: Mapping[str, str]) -> None:
    """Every OTEL_* value `tracing_from_env` parses, parsed alike, with no exporter built
    and no thread started: SettingsError naming a bad one."""
    env = otel_env.otel_env(environ)
    for name in otel_env.exporters(env, "traces"):
        _target(name, env)
    _batching(env)
    _sampler(env)


def _target(name: str, env: Mapping[str, str]) -> otel_env.OtlpTarget | None:
    """Where an exporter named in OTEL_TRACES_EXPORTER sends: OTLP's target, None for the
    console."""
    if name == "console":
        return None
    if name != "otlp":
        raise SettingsError(f"OTEL_TRACES_EXPORTER={name!r}: expected otlp, console or none")
    return otel_env.otlp_target(env, "traces")


def _exporter(target: otel_env.OtlpTarget | None) -> SpanExporter:
    if target is None:
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    return otlp_span_exporter(target)


def _batching(env: Mapping[str, str]) -> dict[str, int]:
    """The batch span processor's sizes and delay (OTEL_BSP_*)."""
    return {
        "max_queue_size": otel_env.count(env, "OTEL_BSP_MAX_QUEUE_SIZE", 2048),
        "schedule_delay_millis": otel_env.count(env, "OTEL_BSP_SCHEDULE_DELAY", 5000),
        "max_export_batch_size": otel_env.count(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512),
    }


def _sampler(env: Mapping[str, str]) -> Sampler:
    name = env.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").lower()
    fixed: dict[str, Sampler] = {
        "always_on": ALWAYS_ON,
        "always_off": ALWAYS_OFF,
        "parentbased_always_on": ParentBased(ALWAYS_ON),
        "parentbased_always_off": ParentBased(ALWAYS_OFF),
    }
    if name in fixed:
        return fixed[name]
    if name not in ("traceidratio", "parentbased_traceidratio"):
        choices = ", ".join([*fixed, "traceidratio", "parentbased_traceidratio"])
        raise SettingsError(f"OTEL_TRACES_SAMPLER={name!r}: expected one of {choices}")
    ratio: float = otel_env.value(env, "OTEL_TRACES_SAMPLER_ARG", _ratio, 1.0)
    ratio_sampler = TraceIdRatioBased(ratio)
    return ratio_sampler if name == "traceidratio" else ParentBased(ratio_sampler)


def _ratio(text: str) -> float:
    ratio = float(text)
    if not 0.0 <= ratio <= 1.0:  # also refuses nan
        raise ValueError("expected a ratio from 0 to 1")
    return ratio
