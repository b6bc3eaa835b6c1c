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
                                                         reasoning.output_tokens)
  gen_ai.client.inference.operation.input_tokens / .output_tokens  {token}  per request

With OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_previous the names of commit 004902b8 instead
(gen_ai.client.operation.duration, .time_to_first_chunk, .time_per_output_chunk and the
gen_ai.client.token.usage histogram by gen_ai.token.type); with gen_ai_previous/dup both.
tokenprobe reads one token total per direction, so the usage counters carry
gen_ai.token.modality "unknown", as the conventions ask when usage is not broken down.

time_to_first_chunk is tokenprobe's TTFT: the first read carrying generated content, not the
first chunk of the stream (vLLM's role-only chunk, Anthropic's message_start), so it equals
tokenprobe_time_to_first_token_seconds. time_per_output_chunk is one value per content chunk
after the first (the inter-token latencies), as the conventions define it. Both only for
streams. Attributes: gen_ai.operation.name, gen_ai.provider.name, gen_ai.request.model and
gen_ai.response.model (bounded like the Prometheus model label), server.address,
server.port, error.type on the duration when the request failed (tokenprobe's closed set of
error types), and each --label-header label. tokenprobe's own figures follow under
tokenprobe.* (the table FIGURES and the counters in `_count`), the conversation figures
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

Only imported when OTEL_METRICS_EXPORTER asks for otlp (see `metrics_requested`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.util import Finalize
from operator import attrgetter
from typing import Any

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from prometheus_client import CollectorRegistry, Counter, Gauge

from proxy.core.buckets import (
    DECODE_SPEED_BUCKETS,
    OVERHEAD_BUCKETS,
    TOKENS_PER_CHUNK_BUCKETS,
    WS_SESSION_BUCKETS,
    bucket_counts,
)
from proxy.core.conversations import Closed
from proxy.core.measurement import Measurement
from proxy.core.wsrecord import WsSessionRecord
from proxy.settings import SettingsError, number, positive_int
from proxy.sinks import otel_env, semconv
from proxy.sinks.cost import PRICE_KEYS, PriceTable, spend
from proxy.sinks.metrics import CACHED_RATIO_BUCKETS, TURN_GAP_BUCKETS, TURNS_BUCKETS
from proxy.sinks.sink import Labels

log = logging.getLogger("tokenprobe")

#: The conventions' advice for every duration histogram: 0.01 s doubling to 81.92 s.
DURATION_BUCKETS = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
#: The conventions' advice for gen_ai.client.token.usage: powers of 4 from 1 to 4**13.
TOKEN_BUCKETS = tuple(float(4**i) for i in range(14))

SCHEMA_URL = "https://opentelemetry.io/schemas/1.42.0"
Key = tuple[tuple[str, Any], ...]


@dataclass(frozen=True, slots=True)
class Instrument:
    name: str
    unit: str
    description: str
    bounds: tuple[float, ...] = ()  # a histogram's; () for a counter


# -- the previous names (semantic-conventions-genai 004902b8) ----------------------------------
OPERATION_DURATION = Instrument(
    "gen_ai.client.operation.duration",
    "s",
    "GenAI operation duration: from the proxy receiving the request to the last byte "
    "relayed to the client (or the request failing).",
    DURATION_BUCKETS,
)
TOKEN_USAGE = Instrument(
    "gen_ai.client.token.usage",
    "{token}",
    "Number of input and output tokens used (backend usage, else the tokenizer, else "
    "content chunks), recorded when the request ends.",
    TOKEN_BUCKETS,
)
TIME_TO_FIRST_CHUNK = Instrument(
    "gen_ai.client.operation.time_to_first_chunk",
    "s",
    "From the proxy receiving the request to the first read carrying generated content "
    "(not the role-only first chunk). Streams only.",
    DURATION_BUCKETS,
)
TIME_PER_OUTPUT_CHUNK = Instrument(
    "gen_ai.client.operation.time_per_output_chunk",
    "s",
    "For each content chunk after the first: from the read carrying the previous one to "
    "the read carrying it (0 when both came in one read). Streams only.",
    DURATION_BUCKETS,
)


# -- the current names (semantic-conventions-genai ac48b1f9 / 27f82f09) -----------------------
INFERENCE_DURATION = Instrument(
    "gen_ai.client.inference.duration",
    "s",
    OPERATION_DURATION.description,
    DURATION_BUCKETS,
)
INFERENCE_TIME_TO_FIRST_CHUNK = Instrument(
    "gen_ai.client.inference.time_to_first_chunk",
    "s",
    TIME_TO_FIRST_CHUNK.description,
    DURATION_BUCKETS,
)
INFERENCE_TIME_PER_OUTPUT_CHUNK = Instrument(
    "gen_ai.client.inference.time_per_output_chunk",
    "s",
    TIME_PER_OUTPUT_CHUNK.description,
    DURATION_BUCKETS,
)
OPERATION_INPUT_TOKENS = Instrument(
    "gen_ai.client.inference.operation.input_tokens",
    "{token}",
    "Input (prompt) tokens per request (backend usage, else the tokenizer), recorded when "
    "the request ends.",
    TOKEN_BUCKETS,
)
OPERATION_OUTPUT_TOKENS = Instrument(
    "gen_ai.client.inference.operation.output_tokens",
    "{token}",
    "Output tokens per request (backend usage, else the tokenizer, else content chunks), "
    "recorded when the request ends.",
    TOKEN_BUCKETS,
)
USAGE_INPUT = Instrument(
    "gen_ai.client.inference.usage.input_tokens",
    "{token}",
    "Input (prompt) tokens, cached ones included, counted when each request ends (0 with "
    "modality unknown when no count was had).",
)
USAGE_OUTPUT = Instrument(
    "gen_ai.client.inference.usage.output_tokens",
    "{token}",
    "Output tokens, reasoning ones included, counted when each request ends (0 with "
    "modality unknown when no count was had).",
)
USAGE_CACHE_READ = Instrument(
    "gen_ai.client.inference.usage.cache_read.input_tokens",
    "{token}",
    "Input tokens the backend served from its prefix cache (usage), when each request ends.",
)
USAGE_REASONING = Instrument(
    "gen_ai.client.inference.usage.reasoning.output_tokens",
    "{token}",
    "Output tokens spent on reasoning (usage), counted when each request ends.",
)
_UNKNOWN_MODALITY = (("gen_ai.token.modality", "unknown"),)


@dataclass(frozen=True, slots=True)
class GenAiInstruments:
    """One name set's duration, first-chunk and per-chunk histograms."""

    duration: Instrument
    time_to_first_chunk: Instrument
    time_per_output_chunk: Instrument


CURRENT = GenAiInstruments(
    INFERENCE_DURATION, INFERENCE_TIME_TO_FIRST_CHUNK, INFERENCE_TIME_PER_OUTPUT_CHUNK
)
PREVIOUS = GenAiInstruments(OPERATION_DURATION, TIME_TO_FIRST_CHUNK, TIME_PER_OUTPUT_CHUNK)

#: Histograms of one figure of the record each: (how to read it from the record,
#: instrument); None is not observed. A new figure on the record (the engine split of
#: TTFT, say) is one more row here and nothing else.
FIGURES: tuple[tuple[Callable[[Measurement], float | None], Instrument], ...] = (
    (
        attrgetter("ttfb"),
        Instrument(
            "tokenprobe.time_to_first_byte",
            "s",
            "From the proxy receiving the request to the upstream's response headers.",
            DURATION_BUCKETS,
        ),
    ),
    (
        attrgetter("tpot"),
        Instrument(
            "tokenprobe.time_per_output_token",
            "s",
            "Per request: (last token time - first token time) / (output tokens - 1).",
            DURATION_BUCKETS,
        ),
    ),
    (
        lambda m: m.ttft_parts()[0],
        Instrument(
            "tokenprobe.engine.queue_time",
            "s",
            "The engine's own queue time (vLLM per-request metrics queue_time_ms): from the "
            "request entering the waiting queue to its first scheduling; for streams the "
            "queue part of the client-seen TTFT (scaled with the engine TTFT when both "
            "exceed it).",
            DURATION_BUCKETS,
        ),
    ),
    (
        lambda m: m.ttft_parts()[1],
        Instrument(
            "tokenprobe.engine.time_to_first_token",
            "s",
            "The engine's own time to first token (time_to_first_token_ms): from the "
            "request's scheduling to its first token.",
            DURATION_BUCKETS,
        ),
    ),
    (
        lambda m: m.ttft_parts()[2],
        Instrument(
            "tokenprobe.time_to_first_token.outside_engine",
            "s",
            "Client-seen TTFT minus the engine's queue time and TTFT, never below 0: "
            "network, the server's HTTP front end and tokenisation, the proxy. Streams "
            "that carried the engine's per-request metrics.",
            DURATION_BUCKETS,
        ),
    ),
    (
        attrgetter("proxy_overhead"),
        Instrument(
            "tokenprobe.proxy_overhead",
            "s",
            "The proxy's own time per request: body read -> request handed upstream, plus "
            "response head from upstream -> sent to the client.",
            OVERHEAD_BUCKETS,
        ),
    ),
    (
        lambda m: m.output_tokens_per_chunk(),
        Instrument(
            "tokenprobe.output_tokens_per_chunk",
            "{token}",
            "Per stream: output tokens (usage or tokenizer) / content events; above 1 with "
            "speculative decoding or multi-token prediction.",
            TOKENS_PER_CHUNK_BUCKETS,
        ),
    ),
    (
        attrgetter("decode_tokens_per_second"),
        Instrument(
            "tokenprobe.decode_speed",
            "{token}/s",
            "Per request single-stream speed: (output tokens - 1) / (last token time - first "
            "token time). Not aggregate throughput.",
            tuple(DECODE_SPEED_BUCKETS),
        ),
    ),
)

REQUESTS = Instrument(
    "tokenprobe.requests",
    "{request}",
    "Measured requests finished, by HTTP status, finish reason (tokenprobe's closed set) "
    "and error.type when one failed.",
)
CACHED_TOKENS = Instrument(
    "tokenprobe.usage.cached_input_tokens",
    "{token}",
    "Prompt tokens served from the backend's prefix cache, from usage.",
)


def cost_instrument(currency: str) -> Instrument:
    return Instrument(
        "tokenprobe.cost",
        f"{{{currency}}}",
        "Spend in the price table's currency (tokenprobe.currency), from the token counts "
        "recorded when each request ended, by tokenprobe.cost.kind: input (uncached prompt "
        "tokens), cached_input, output.",
    )


IN_FLIGHT = Instrument(
    "tokenprobe.requests.in_flight",
    "{request}",
    "Measured requests between the proxy receiving them and their last byte.",
)

# -- conversations (proxy/core/conversations.py, docs/conversations.md) ----------------------
# The same figures and buckets as the Prometheus conversation metrics; a continuation's
# carry tokenprobe.conversation.via (header, previous_response, messages), a closed
# conversation's only server.* (it is no request: no model, no operation).
CONTINUATIONS = Instrument(
    "tokenprobe.conversation.continuations",
    "{request}",
    "Measured requests that continue an earlier one's conversation, by how that was "
    "recognised (tokenprobe.conversation.via), counted when each ends.",
)
TURN_GAP = Instrument(
    "tokenprobe.conversation.turn_gap",
    "s",
    "Time between a conversation's turns, outside the model: from the end of the previous "
    "request's response (its last byte relayed) to the proxy receiving the continuation. "
    "Not recorded while the previous request is still in flight.",
    TURN_GAP_BUCKETS,
)
CACHED_RATIO = Instrument(
    "tokenprobe.continuation.cached_prompt_ratio",
    "1",
    "A continuation's cached prompt tokens as its backend reported them (usage), over the "
    "tokens of the earlier prompt it repeats, at most 1; only when cached tokens were "
    "reported.",
    CACHED_RATIO_BUCKETS,
)
CACHE_MISSES = Instrument(
    "tokenprobe.continuation.cache_misses",
    "{request}",
    "Continuations whose cached prompt tokens cover less than "
    "--continuation-cache-miss-ratio of the prompt they repeat (0 for every model with a "
    "measured continuation, so the share of misses is defined).",
)
CONVERSATION_TURNS = Instrument(
    "tokenprobe.conversation.turns",
    "{request}",
    "Requests per conversation, recorded when it ends: --conversation-idle seconds after "
    "its last request's end.",
    TURNS_BUCKETS,
)
CONVERSATION_DURATION = Instrument(
    "tokenprobe.conversation.duration",
    "s",
    "A conversation's length, recorded when it ends: from the proxy receiving its first "
    "request to the end of its last request's response.",
    WS_SESSION_BUCKETS,
)
CONVERSATION_MODEL_TIME = Instrument(
    "tokenprobe.conversation.model_time",
    "s",
    "A conversation's time in the model, recorded when it ends: the sum over its requests "
    "of the proxy receiving each to the end of its response.",
    WS_SESSION_BUCKETS,
)
CONVERSATION_BETWEEN_TIME = Instrument(
    "tokenprobe.conversation.between_requests",
    "s",
    "A conversation's time between requests, recorded when it ends: the sum of its turn gaps.",
    WS_SESSION_BUCKETS,
)

# -- WebSocket sessions (proxy/core/wsrecord.py): tokenprobe_websocket_sessions_total and
# tokenprobe_websocket_session_duration_seconds, by tokenprobe.websocket.route (a WsApi's
# endpoint, else "other") and, on the counter, tokenprobe.websocket.outcome.
WS_SESSIONS = Instrument(
    "tokenprobe.websocket.sessions",
    "{session}",
    "WebSocket upgrade requests the proxy tunnelled (or tried to), counted when the tunnel "
    "ended, by route and outcome (tokenprobe_websocket_sessions_total's closed set).",
)
WS_SESSION_DURATION = Instrument(
    "tokenprobe.websocket.session.duration",
    "s",
    "WebSocket session duration: from the upgrade request's arrival to the close (the first "
    "side's connection ending, the idle timeout or the drain closing it).",
    WS_SESSION_BUCKETS,
)

TEMPORALITIES = ("cumulative", "delta", "lowmemory")


class _Points:
    """One histogram's points, by attribute key."""

    __slots__ = ("bounds", "points")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        # key -> [count, sum, min, max, bucket counts...]
        self.points: dict[Key, list[Any]] = {}

    def add(self, key: Key, values: Sequence[float]) -> None:
        point = self.points.get(key)
        if point is None:
            point = self.points[key] = [0, 0.0, math.inf, -math.inf] + [0] * (len(self.bounds) + 1)
        bounds = self.bounds
        if len(values) == 1:
            value = values[0]
            point[4 + bisect_left(bounds, value)] += 1  # the first bound >= value, as le
        else:  # a stream's chunk gaps
            for i, n in enumerate(bucket_counts(bounds, values), 4):
                if n:
                    point[i] += n
        point[0] += len(values)
        point[1] += sum(values)
        point[2] = min(point[2], *values)
        point[3] = max(point[3], *values)


class OtlpMetrics:
    """A Sink aggregating records into OTLP metrics; `start` begins periodic export."""

    def __init__(
        self,
        exporter: MetricExporter,
        *,
        upstream: str,
        failures: Counter,
        models: Callable[[str], str],
        resource: Resource,
        interval: float = 60.0,
        export_timeout: float = 30.0,
        delta: bool = False,
        attribution: tuple[str, ...] = (),
        prices: PriceTable | None = None,
        in_flight: Gauge | None = None,
        names: semconv.Names = semconv.DEFAULT,
        miss_ratio: float = 0.5,
    ) -> None:
        """`miss_ratio`: --continuation-cache-miss-ratio, the tracker's threshold."""
        self.exporter = exporter
        self.miss_ratio = miss_ratio
        self.names = names
        self._genai = (CURRENT,) * names.current + (PREVIOUS,) * names.previous
        self.interval = interval
        self.export_timeout = export_timeout
        self.delta = delta
        self.resource = resource
        self.attribution = attribution
        self.prices = prices
        self._cost = cost_instrument(prices.currency) if prices is not None else None
        self.in_flight = in_flight
        self._failed = failures.labels("export")
        self._models = models
        self._server = semconv.server_attributes(upstream)
        self._operations: dict[str, Key] = {}
        self._lock = threading.Lock()
        self._histograms: dict[Instrument, _Points] = {}
        self._sums: dict[Instrument, dict[Key, float]] = {}
        self._start_ns = self._last_ns = time.time_ns()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._finalizer: Finalize | None = None

    # -- recording (event loop) -------------------------------------------------------------

    def record(self, m: Measurement, labels: Labels) -> None:
        base = self._base(m, labels)
        error = m.error_type.value if m.error_type is not None else None
        failed = (*base, ("error.type", error)) if error else base
        with self._lock:
            for genai in self._genai:
                self._observe(genai.duration, failed, (m.e2e,))
                if m.ttft is not None:
                    self._observe(genai.time_to_first_chunk, base, (m.ttft,))
                if m.inter_token_latencies:
                    self._observe(genai.time_per_output_chunk, base, m.inter_token_latencies)
            for getter, instrument in FIGURES:
                value = getter(m)
                if value is not None:
                    self._observe(instrument, base, (value,))
            if self.names.previous:
                self._token_usage(m, base)
            if self.names.current:
                self._inference_usage(m, base, failed)
            self._count(m, base, error)
            if m.continued_via is not None:
                self._continuation(m, base)

    def _continuation(self, m: Measurement, base: Key) -> None:
        """The per-continuation figures the tracker put on the record (its via, gap and
        shared prefix), as proxy/sinks/conversations.py observes them in Prometheus."""
        via = (*base, ("tokenprobe.conversation.via", m.continued_via))
        self._add(CONTINUATIONS, via, 1)
        if m.turn_gap is not None:
            self._observe(TURN_GAP, via, (m.turn_gap,))
        ratio = m.continuation_cache_ratio()
        if ratio is not None:
            self._observe(CACHED_RATIO, base, (ratio,))
            self._add(CACHE_MISSES, base, 1 if ratio < self.miss_ratio else 0)

    def conversations_closed(self, closed: Sequence[Closed]) -> None:
        """Conversations that went idle (the tracker's sweep, proxy/sinks/conversations.py)."""
        key = self._server
        with self._lock:
            for c in closed:
                self._observe(CONVERSATION_TURNS, key, (c.turns,))
                self._observe(CONVERSATION_DURATION, key, (c.duration,))
                self._observe(CONVERSATION_MODEL_TIME, key, (c.model_seconds,))
                self._observe(CONVERSATION_BETWEEN_TIME, key, (c.between_seconds,))

    def session(self, record: WsSessionRecord) -> None:
        """A WebSocket tunnel ended (`Sinks.session_ended`): no request, so no model nor
        operation, only its route, outcome and server.*."""
        route: Key = (("tokenprobe.websocket.route", record.route), *self._server)
        with self._lock:
            self._add(WS_SESSIONS, (*route, ("tokenprobe.websocket.outcome", record.outcome)), 1)
            self._observe(WS_SESSION_DURATION, route, (record.duration,))

    def _token_usage(self, m: Measurement, base: Key) -> None:
        """The previous names: one histogram by gen_ai.token.type."""
        if m.prompt_tokens is not None:
            self._observe(TOKEN_USAGE, (*base, ("gen_ai.token.type", "input")), (m.prompt_tokens,))
        if m.output_tokens is not None:
            self._observe(TOKEN_USAGE, (*base, ("gen_ai.token.type", "output")), (m.output_tokens,))

    def _inference_usage(self, m: Measurement, base: Key, failed: Key) -> None:
        """The current names: counters for every request, failed ones included (0 when no
        count was had), and per-request histograms with error.type."""
        usage = base + _UNKNOWN_MODALITY
        self._add(USAGE_INPUT, usage, m.prompt_tokens or 0)
        self._add(USAGE_OUTPUT, usage, m.output_tokens or 0)
        if m.cached_prompt_tokens is not None:
            self._add(USAGE_CACHE_READ, usage, m.cached_prompt_tokens)
        if (reasoning := semconv.reasoning_tokens(m)) is not None:
            self._add(USAGE_REASONING, usage, reasoning)
        if m.prompt_tokens is not None:
            self._observe(OPERATION_INPUT_TOKENS, failed, (m.prompt_tokens,))
        if m.output_tokens is not None:
            self._observe(OPERATION_OUTPUT_TOKENS, failed, (m.output_tokens,))

    def _count(self, m: Measurement, base: Key, error: str | None) -> None:
        outcome: Key = (
            ("http.response.status_code", m.status_code),
            ("tokenprobe.finish_reason", m.finish_reason),
        )
        if error:
            outcome += (("error.type", error),)
        self._add(REQUESTS, base + outcome, 1)
        if m.cached_prompt_tokens:
            self._add(CACHED_TOKENS, base, m.cached_prompt_tokens)
        if self.prices is None or self._cost is None:
            return
        if (price := self.prices.get(m.model)) is not None:
            # The model is in the price table here, so the attribute stays bounded by it.
            currency = ("tokenprobe.currency", self.prices.currency)
            for kind, amount in zip(PRICE_KEYS, spend(price, m), strict=True):
                if amount:
                    key = (*base, ("tokenprobe.cost.kind", kind), currency)
                    self._add(self._cost, key, amount)

    def _base(self, m: Measurement, labels: Labels) -> Key:
        operation = self._operations.get(m.endpoint)
        if operation is None:
            operation = self._operations[m.endpoint] = semconv.operation_attributes(m.endpoint)
        key = operation
        if m.model:
            key += (("gen_ai.request.model", labels.model),)
        if m.response_model:
            key += (("gen_ai.response.model", self._models(m.response_model)),)
        key += self._server
        if self.attribution:
            key += tuple(zip(self.attribution, labels.attribution, strict=True))
        return key

    def _observe(self, instrument: Instrument, key: Key, values: Sequence[float]) -> None:
        points = self._histograms.get(instrument)
        if points is None:
            points = self._histograms[instrument] = _Points(instrument.bounds)
        points.add(key, values)

    def _add(self, instrument: Instrument, key: Key, amount: float) -> None:
        sums = self._sums.setdefault(instrument, {})
        sums[key] = sums.get(key, 0) + amount

    # -- export (its own thread) ------------------------------------------------------------

    def collect(self) -> MetricsData | None:
        """Everything recorded so far (cumulative) or since the last collect (delta)."""
        now = time.time_ns()
        with self._lock:
            histograms: dict[Instrument, dict[Key, list[Any]]]
            if self.delta:
                histograms = {i: p.points for i, p in self._histograms.items()}
                sums = self._sums
                self._histograms, self._sums = {}, {}
                start = self._last_ns
            else:
                histograms = {
                    i: {k: list(v) for k, v in p.points.items()}
                    for i, p in self._histograms.items()
                }
                sums = {i: dict(s) for i, s in self._sums.items()}
                start = self._start_ns
            self._last_ns = now
        temporality = (
            AggregationTemporality.DELTA if self.delta else AggregationTemporality.CUMULATIVE
        )
        metrics = [_histogram(i, p, start, now, temporality) for i, p in histograms.items()]
        metrics += [_sum(i, s, start, now, temporality, True) for i, s in sums.items()]
        if (in_flight := self._in_flight(now)) is not None:
            metrics.append(in_flight)
        if not metrics:
            return None
        scope = ScopeMetrics(InstrumentationScope("tokenprobe"), metrics, SCHEMA_URL)
        return MetricsData([ResourceMetrics(self.resource, [scope], SCHEMA_URL)])

    def _in_flight(self, now: int) -> Metric | None:
        """The Prometheus in-flight gauge's values in this process, as an UpDownCounter."""
        if self.in_flight is None:
            return None
        values: dict[Key, float] = {}
        for family in self.in_flight.collect():
            for sample in family.samples:
                model, endpoint = sample.labels["model"], sample.labels["endpoint"]
                key: Key = (
                    *semconv.operation_attributes(endpoint),
                    ("gen_ai.request.model", model),
                    *self._server,
                )
                values[key] = values.get(key, 0) + sample.value
        if not values:
            return None
        return _sum(
            IN_FLIGHT, values, self._start_ns, now, AggregationTemporality.CUMULATIVE, False
        )

    def export_once(self) -> bool:
        """Collect and export; False (and counted) when the export failed."""
        try:
            data = self.collect()
            if data is None:
                return True
            result = self.exporter.export(data, timeout_millis=self.export_timeout * 1000)
        except Exception:
            log.exception("exporting OTLP metrics failed")
            result = MetricExportResult.FAILURE
        if result is not MetricExportResult.SUCCESS:
            self._failed.inc()
            return False
        return True

    def start(self) -> OtlpMetrics:
        self._thread = threading.Thread(
            target=self._run, name="tokenprobe-otlp-metrics", daemon=True
        )
        self._thread.start()
        # At exit, in the main process and in uvicorn's worker processes alike (which leave
        # through os._exit, skipping atexit, but run multiprocessing's finalizers first).
        self._finalizer = Finalize(None, self.shutdown, exitpriority=10)
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.export_once()

    def shutdown(self) -> None:
        """Stop the thread, export what is left, close the exporter. Blocking; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._finalizer is not None:
            self._finalizer.cancel()
        if self._thread is not None:
            self._thread.join(self.export_timeout)
        self.export_once()
        self.exporter.shutdown(timeout_millis=self.export_timeout * 1000)


def _histogram(
    instrument: Instrument,
    points: Mapping[Key, list[Any]],
    start: int,
    now: int,
    temporality: AggregationTemporality,
) -> Metric:
    data = [
        HistogramDataPoint(
            attributes=dict(key),
            start_time_unix_nano=start,
            time_unix_nano=now,
            count=p[0],
            sum=p[1],
            bucket_counts=p[4:],
            explicit_bounds=instrument.bounds,
            min=p[2],
            max=p[3],
        )
        for key, p in points.items()
    ]
    return Metric(
        instrument.name, instrument.description, instrument.unit, Histogram(data, temporality)
    )


def _sum(
    instrument: Instrument,
    values: Mapping[Key, float],
    start: int,
    now: int,
    temporality: AggregationTemporality,
    monotonic: bool,
) -> Metric:
    data = [NumberDataPoint(dict(key), start, now, value) for key, value in values.items()]
    return Metric(
        instrument.name, instrument.description, instrument.unit, Sum(data, temporality, monotonic)
    )


# -- configuration from the standard OTEL_* variables ----------------------------------------


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
    key = "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE"
    temporality = env.get(key, "cumulative").lower()
    if temporality not in TEMPORALITIES:
        raise SettingsError(f"{key}={env[key]!r}: expected one of {', '.join(TEMPORALITIES)}")
    interval_ms: int = otel_env.value(env, "OTEL_METRIC_EXPORT_INTERVAL", positive_int, 60_000)
    timeout_ms: float = otel_env.value(env, "OTEL_METRIC_EXPORT_TIMEOUT", number, 30_000.0)
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
