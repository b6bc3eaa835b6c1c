"""The OTLP metrics sink: the same records the Prometheus sink reads, pushed to a collector.

Names, units, attributes and bucket boundaries follow the GenAI semantic conventions'
client metrics, pinned in proxy/sinks/semconv.py (status Development; server.* from
semantic-conventions v1.42.0). By default the current names
(open-telemetry/semantic-conventions-genai at ac48b1f9, docs/gen-ai/client-inference.md
and docs/gen-ai/gen-ai-token-metrics.md at 27f82f09):

  gen_ai.client.inference.duration              s        e2e: request received -> last byte
  gen_ai.client.inference.time_to_first_chunk   s        request received -> first *content* chunk
  gen_ai.client.inference.time_per_output_chunk s        each gap between content chunks
  gen_ai.client.inference.usage.input_tokens    {token}  counter, by gen_ai.token.modality
  gen_ai.client.inference.usage.output_tokens   {token}  counter (also cache_read.input_tokens,
                                                         cache_write.input_tokens,
                                                         reasoning.output_tokens)
  gen_ai.client.inference.operation.input_tokens / .output_tokens  {token}  per request,
                                                         failed ones too (0 without usage;
                                                         none where content chunks were
                                                         counted: those are no tokens)

and for gen_ai.operation.name "embeddings" (docs/gen-ai/client-embeddings.md at 88eccb15)
gen_ai.client.embeddings.duration and gen_ai.client.embeddings.operation.input_tokens
instead of the inference duration and input histogram; no output metric for any API that
generates nothing.

With OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_previous the names of commit 004902b8 instead
(gen_ai.client.operation.duration, .time_to_first_chunk, .time_per_output_chunk and the
gen_ai.client.token.usage histogram by gen_ai.token.type); with gen_ai_previous/dup both.
tokenprobe reads one token total per direction, so the usage counters carry
gen_ai.token.modality "unknown", as the conventions ask when usage is not broken down.

time_to_first_chunk is tokenprobe's TTFT: the first read carrying generated content, not the
first chunk of the stream (vLLM's role-only chunk, Anthropic's message_start), so it equals
tokenprobe_time_to_first_token_seconds. time_per_output_chunk is one value per content chunk
after the first (the inter-token latencies), as the conventions define it. Both only for
streams. Attributes: gen_ai.operation.name, gen_ai.provider.name, tokenprobe.model (the
Prometheus model label), gen_ai.request.model and gen_ai.response.model (the exact names,
only when vouched for: semconv.vouched_model), server.address, server.port, error.type on
the duration when the request failed (tokenprobe's closed set of error types), and each --label-header label. tokenprobe's own figures follow under
tokenprobe.* (the table FIGURES and the counters in `OtlpMetrics._count`), the conversation figures
too (tokenprobe.conversation.*, tokenprobe.continuation.*: per continuation from its
record, per conversation when the tracker closes it, `conversations_closed`), and each
WebSocket session when its tunnel ends (tokenprobe.websocket.*, `session`: the Prometheus
sessions counter and duration, the same route and outcome).

Why not the SDK's meters: one `Histogram.record` costs about 10 us, and a stream records one
value per chunk. Here a request takes one lock and a few dict look-ups, its chunk gaps one
bisect each; a daemon thread builds the SDK's own MetricsData every interval and hands it
to the SDK's OTLP exporter (http/protobuf or grpc). A dead or slow collector only holds up
that thread; each failed export is counted in tokenprobe_metric_export_failures_total
(with delta temporality that interval's data is lost; with cumulative the next export
carries it).

The package by role: instruments.py (every instrument: name, unit, description, bounds),
points.py (aggregation into flat points, and the SDK's metric data made from them),
sink.py (`OtlpMetrics`: recording, attribute building, collect, the export thread),
config.py (the sink from the OTEL_* variables, the export failures counter).

Only imported when OTEL_METRICS_EXPORTER asks for otlp (see `metrics_requested`).
"""

from proxy.sinks.otlp.config import TEMPORALITIES, metric_export_failures, otlp_metrics_from_env
from proxy.sinks.otlp.instruments import (
    CURRENT,
    DURATION_BUCKETS,
    FIGURES,
    PREVIOUS,
    TOKEN_BUCKETS,
    WS_SESSION_DURATION,
    WS_SESSIONS,
    Instrument,
)
from proxy.sinks.otlp.sink import SCHEMA_URL, OtlpMetrics

__all__ = [
    "CURRENT",
    "DURATION_BUCKETS",
    "FIGURES",
    "PREVIOUS",
    "SCHEMA_URL",
    "TEMPORALITIES",
    "TOKEN_BUCKETS",
    "WS_SESSIONS",
    "WS_SESSION_DURATION",
    "Instrument",
    "OtlpMetrics",
    "metric_export_failures",
    "otlp_metrics_from_env",
]
