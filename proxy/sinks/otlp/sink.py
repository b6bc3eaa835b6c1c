"""The OTLP metrics sink: records in (`record`, `conversations_closed`, `session`,
`late_tokens`), one lock and a few dict updates each; `collect` turns what was recorded into the SDK's
MetricsData, and a daemon thread (`start`) hands that to the exporter every interval.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.util import Finalize
from typing import Any, NamedTuple

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from prometheus_client import Counter, Gauge

from proxy.core.background import LateTokens
from proxy.core.conversations import Closed
from proxy.core.measurement import Measurement, TokenSource
from proxy.core.wsrecord import WsSessionRecord
from proxy.core.wsseam import seam_of
from proxy.sinks import semconv
from proxy.sinks.cost import PRICE_KEYS, PriceTable, late_spend, spend
from proxy.sinks.otlp.instruments import (
    CACHE_MISSES,
    CACHED_RATIO,
    CACHED_TOKENS,
    CONTINUATIONS,
    CONVERSATION_BETWEEN_TIME,
    CONVERSATION_DURATION,
    CONVERSATION_MODEL_TIME,
    CONVERSATION_TURNS,
    CURRENT,
    EMBEDDINGS,
    EMBEDDINGS_INPUT_TOKENS,
    FIGURES,
    IN_FLIGHT,
    OPERATION_INPUT_TOKENS,
    OPERATION_OUTPUT_TOKENS,
    PREVIOUS,
    REQUESTS,
    TOKEN_USAGE,
    TURN_GAP,
    UNKNOWN_MODALITY,
    USAGE_CACHE_READ,
    USAGE_CACHE_WRITE,
    USAGE_INPUT,
    USAGE_OUTPUT,
    USAGE_REASONING,
    WS_SESSION_DURATION,
    WS_SESSIONS,
    GenAiInstruments,
    Instrument,
    cost_instrument,
)
from proxy.sinks.otlp.points import Key, Points, histogram_metric, sum_metric
from proxy.sinks.sink import Labels

log = logging.getLogger("tokenprobe")

#: The traces' schema URL too, so that both signals say the same (proxy/sinks/semconv.py).
SCHEMA_URL = semconv.SCHEMA_URL


class _Operation(NamedTuple):
    """What an endpoint's records are recorded as, found once per endpoint."""

    key: Key  # gen_ai.operation.name and gen_ai.provider.name
    genai: tuple[GenAiInstruments, ...]  # the duration and chunk histograms, by name set
    embeddings: bool  # gen_ai.operation.name "embeddings": the embeddings instruments
    generative: bool  # False: no output tokens to count (embeddings, score, rerank, ...)


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
        self._operations: dict[str, _Operation] = {}
        self._lock = threading.Lock()
        self._histograms: dict[Instrument, Points] = {}
        self._sums: dict[Instrument, dict[Key, float]] = {}
        self._start_ns = self._last_ns = time.time_ns()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._finalizer: Finalize | None = None

    # -- recording (event loop) -------------------------------------------------------------

    def record(self, m: Measurement, labels: Labels) -> None:
        operation = self._operation(m.endpoint)
        base = self._base(m.model, m.response_model, labels, operation.key)
        error = m.error_type.value if m.error_type is not None else None
        failed = (*base, ("error.type", error)) if error else base
        with self._lock:
            for genai in operation.genai:
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
                self._inference_usage(m, base, failed, operation)
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

    def late_tokens(self, t: LateTokens, labels: Labels) -> None:
        """A background Response's tokens, counted after its POST's record (proxy/core/
        background.py), with the POST's labels: the usage counters of the current names
        (cache reads and writes included) and tokenprobe.usage.cached_input_tokens, and
        tokenprobe.cost as `_count` adds a request's; not the per-request histograms (the
        previous names' gen_ai.client.token.usage is one: nothing there), nor requests or
        durations."""
        operation = self._operation(t.endpoint)
        base = self._base(t.model, t.response_model, labels, operation.key)
        usage = base + UNKNOWN_MODALITY
        with self._lock:
            if self.names.current:
                if t.prompt_tokens is not None:
                    self._add(USAGE_INPUT, usage, t.prompt_tokens)
                if t.output_tokens is not None and operation.generative:
                    self._add(USAGE_OUTPUT, usage, t.output_tokens)
                if t.cached_prompt_tokens is not None:
                    self._add(USAGE_CACHE_READ, usage, t.cached_prompt_tokens)
                if t.cache_write_tokens is not None:
                    self._add(USAGE_CACHE_WRITE, usage, t.cache_write_tokens)
                reasoning = t.reasoning_tokens
                if reasoning is not None and t.reasoning_token_source != "events":
                    self._add(USAGE_REASONING, usage, reasoning)
            if t.cached_prompt_tokens:
                self._add(CACHED_TOKENS, base, t.cached_prompt_tokens)
            if self.prices is None or self._cost is None:
                return
            if (price := self.prices.get(t.model)) is not None:  # bounded by the table
                currency = ("tokenprobe.currency", self.prices.currency)
                for kind, amount in zip(PRICE_KEYS, late_spend(price, t), strict=True):
                    if amount:
                        key = (*base, ("tokenprobe.cost.kind", kind), currency)
                        self._add(self._cost, key, amount)

    def _token_usage(self, m: Measurement, base: Key) -> None:
        """The previous names: one histogram by gen_ai.token.type."""
        if m.prompt_tokens is not None:
            self._observe(TOKEN_USAGE, (*base, ("gen_ai.token.type", "input")), (m.prompt_tokens,))
        if (output := _output_tokens(m)) is not None:
            self._observe(TOKEN_USAGE, (*base, ("gen_ai.token.type", "output")), (output,))

    def _inference_usage(self, m: Measurement, base: Key, failed: Key, op: _Operation) -> None:
        """The current names: counters for every request, failed ones included (0 when no
        count was had), and per-request histograms with error.type, failed requests too:
        "Instrumentations SHOULD record this metric for each inference operation, including
        failed ones. The recorded value SHOULD match the token count returned by the
        provider, or `0` if the response was not received or did not contain token usage"
        (docs/gen-ai/gen-ai-token-metrics.md @ 066d4a7f). A count of content chunks is no
        token count (`_output_tokens`): no output point then ("MUST NOT report": 0 would
        say none came), nor an input point for a request that succeeded without usage (its
        tokens could not be had); but a failed one (a stream cut short before its usage)
        has its input point, 0 where its prompt was not counted, as the failed operation it
        is: 0 is what the conventions ask of one whose response "did not contain token
        usage", and no chunk count goes into it. Output only where the API generates;
        embeddings have their own input histogram and no output metric
        (docs/gen-ai/client-embeddings.md @ 88eccb15), and it has no error.type."""
        usage = base + UNKNOWN_MODALITY
        output = _output_tokens(m)
        self._add(USAGE_INPUT, usage, m.prompt_tokens or 0)
        if op.generative:
            self._add(USAGE_OUTPUT, usage, output or 0)
        if m.cached_prompt_tokens is not None:
            self._add(USAGE_CACHE_READ, usage, m.cached_prompt_tokens)
        if m.cache_write_tokens is not None:
            self._add(USAGE_CACHE_WRITE, usage, m.cache_write_tokens)
        reasoning = semconv.reasoning_tokens(m)
        if reasoning is not None and m.reasoning_token_source != "events":  # as _output_tokens
            self._add(USAGE_REASONING, usage, reasoning)
        if op.embeddings:
            if m.prompt_tokens is not None:
                self._observe(EMBEDDINGS_INPUT_TOKENS, base, (m.prompt_tokens,))
            return
        chunks = m.token_source is TokenSource.CHUNKS
        if m.prompt_tokens is not None or not chunks or m.error_type is not None:
            self._observe(OPERATION_INPUT_TOKENS, failed, (m.prompt_tokens or 0,))
        if op.generative and not chunks:
            self._observe(OPERATION_OUTPUT_TOKENS, failed, (output or 0,))

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

    def _operation(self, endpoint: str) -> _Operation:
        operation = self._operations.get(endpoint)
        if operation is None:
            seam = seam_of(endpoint)
            embeddings = seam.operation == "embeddings"
            genai = (EMBEDDINGS if embeddings else CURRENT,) * self.names.current
            operation = self._operations[endpoint] = _Operation(
                semconv.operation_attributes(endpoint),
                genai + (PREVIOUS,) * self.names.previous,
                embeddings,
                seam.generative,
            )
        return operation

    def _base(self, model: str, response_model: str | None, labels: Labels, operation: Key) -> Key:
        # The model attributes stay as bounded as the Prometheus label (an OTLP backend
        # aggregates by attribute set), without putting the label's values where the
        # conventions want a model's exact name: gen_ai.request.model is the name the
        # client sent and gen_ai.response.model the name the backend answered with, each
        # only when vouched for (semconv.vouched_model); the label, `other` included, is
        # tokenprobe.model, as in Prometheus.
        key = (*operation, ("tokenprobe.model", labels.model))
        if (requested := semconv.vouched_model(model, labels.model)) is not None:
            key += (("gen_ai.request.model", requested),)
        answered = response_model
        if answered and semconv.vouched_model(answered, self._models(answered)) is not None:
            key += (("gen_ai.response.model", answered),)
        key += self._server
        if self.attribution:
            key += tuple(zip(self.attribution, labels.attribution, strict=True))
        return key

    def _observe(self, instrument: Instrument, key: Key, values: Sequence[float]) -> None:
        points = self._histograms.get(instrument)
        if points is None:
            points = self._histograms[instrument] = Points(instrument.bounds)
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
        metrics = [histogram_metric(i, p, start, now, temporality) for i, p in histograms.items()]
        metrics += [sum_metric(i, s, start, now, temporality, True) for i, s in sums.items()]
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
                # Only the label: the gauge keeps no request's own name to vouch for.
                key: Key = (
                    *semconv.operation_attributes(endpoint),
                    ("tokenprobe.model", model),
                    *self._server,
                )
                values[key] = values.get(key, 0) + sample.value
        if not values:
            return None
        return sum_metric(
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
        # The app's shutdown calls `shutdown` (proxy/server/app.py: a `--workers` process is
        # ended by the SIGTERM uvicorn raises again after it, before any exit handler);
        # this finalizer covers a process that stops without one.
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


def _output_tokens(m: Measurement) -> int | None:
    """The output tokens the usage instruments may carry: none when they are a count of
    content chunks (no usage, no tokenizer), which is not a token count. The conventions:
    "If instrumentation cannot efficiently obtain number of input and/or output tokens, it
    MAY allow users to enable offline token counting. Otherwise it MUST NOT report usage
    metric" (semantic-conventions, docs/gen-ai/gen-ai-metrics.md, gen_ai.client.token.usage);
    `--tokenizer` is that offline counting. Prometheus keeps them, labelled source="chunks"."""
    return None if m.token_source is TokenSource.CHUNKS else m.output_tokens
