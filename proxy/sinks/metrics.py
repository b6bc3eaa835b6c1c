"""The Prometheus sink: one Measurement in, a handful of observations out.

Names mirror vLLM's own metrics with the `tokenprobe_` prefix and use vLLM's bucket
boundaries, so a dashboard can put client-seen and server-side figures side by side.
Labels come from closed sets only: the model label is bounded by `ModelLabels`, the
endpoint is one Api's canonical path (proxy/core/apis ENDPOINTS), finish reasons are
mapped onto FINISH_LABELS by each Api, error types and token sources are enums.
Non-generative APIs (embeddings, pooling, score, rerank, classify) observe only e2e
latency, time to first byte, prompt tokens and the request counter.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from proxy.core.apis import FINISH_LABELS
from proxy.core.measurement import NONE_LABEL, Measurement

# vLLM's boundaries (vllm/v1/metrics/loggers.py), so the two can be compared bucket for bucket.
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                         2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Sub-millisecond resolution matters for the time to first byte of a nearby backend.
TTFB_BUCKETS = (0.0005, *TTFT_BUCKETS)
DECODE_SPEED_BUCKETS = (1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 75.0, 100.0, 150.0,
                        200.0, 300.0, 500.0, 1000.0, 2000.0)
# fmt: on


def token_buckets(max_value: int = 1_000_000) -> tuple[float, ...]:
    """vLLM's 1-2-5 series up to max_value."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(out)
            out.append(float(value))
        exponent += 1


LABELS = ("model", "endpoint")

#: finish_reason label values (each Api maps its raw reasons onto them).
FINISH_REASONS = FINISH_LABELS


class Metrics:
    """All of tokenprobe's Prometheus metrics, registered on one registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        h = _factory(Histogram, registry)
        c = _factory(Counter, registry)
        self.ttfb = h(
            "tokenprobe_time_to_first_byte_seconds",
            "Client-seen time to first byte: from the proxy receiving the request to the "
            "upstream's response headers.",
            buckets=TTFB_BUCKETS,
        )
        self.ttft = h(
            "tokenprobe_time_to_first_token_seconds",
            "Client-seen time to first token: from the proxy receiving the request to the first "
            "network read carrying generated content as the API defines it (chat: non-empty "
            "content, reasoning or tool_calls, not the role-only first chunk; Messages: a "
            "content_block_delta, not message_start; Responses: an output/reasoning/"
            "arguments delta, not response.created). Streaming generative requests only.",
            buckets=TTFT_BUCKETS,
        )
        self.itl = h(
            "tokenprobe_inter_token_latency_seconds",
            "Client-seen gap between consecutive content events of one choice of a stream, "
            "from the read carrying one to the read carrying the next (0 when both came in "
            "one read).",
            buckets=TOKEN_LATENCY_BUCKETS,
        )
        self.tpot = h(
            "tokenprobe_request_time_per_output_token_seconds",
            "Per request: (last token time - first token time) / (output tokens - 1); "
            "requests with at least 2 output tokens; with n > 1 choices, the median choice's.",
            buckets=TOKEN_LATENCY_BUCKETS,
        )
        self.decode_speed = h(
            "tokenprobe_request_decode_tokens_per_second",
            "Per request single-stream generation speed: (output tokens - 1) / (last token "
            "time - first token time). Not aggregate throughput.",
            buckets=DECODE_SPEED_BUCKETS,
        )
        self.e2e = h(
            "tokenprobe_e2e_request_latency_seconds",
            "End-to-end latency: from the proxy receiving the request to the last byte "
            "relayed to the client (or the request failing).",
            buckets=E2E_BUCKETS,
        )
        self.prompt_tokens = h(
            "tokenprobe_request_prompt_tokens",
            "Prompt tokens per request (from usage, else the tokenizer).",
            buckets=token_buckets(),
        )
        self.generation_tokens = h(
            "tokenprobe_request_generation_tokens",
            "Output tokens per request (from usage, else the tokenizer, else content events).",
            buckets=token_buckets(),
        )
        self.requests = c(
            "tokenprobe_requests",
            "Measured requests finished, by HTTP status the client got, finish_reason mapped "
            "onto one closed set across APIs (Anthropic max_tokens and Responses "
            "max_output_tokens are 'length'; 'none' if absent) and error type ('none' on "
            "success).",
            labels=("code", "finish_reason", "error_type"),
        )
        self.prompt_tokens_total = c(
            "tokenprobe_prompt_tokens",
            "Prompt tokens of finished requests, by where the count came from.",
            labels=("source",),
        )
        self.generation_tokens_total = c(
            "tokenprobe_generation_tokens",
            "Output tokens of finished requests, by where the count came from.",
            labels=("source",),
        )
        self.cached_prompt_tokens_total = c(
            "tokenprobe_cached_prompt_tokens",
            "Prompt tokens served from the backend's prefix cache "
            "(usage.prompt_tokens_details.cached_tokens).",
        )
        self.in_flight = Gauge(
            "tokenprobe_requests_in_flight",
            "Measured requests between the proxy receiving them and their last byte.",
            LABELS,
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.measurement_failures = Counter(
            "tokenprobe_measurement_failures",
            "Times measuring failed while the request itself went on, by stage.",
            ("stage",),
            registry=registry,
        )
        self.passthrough = Counter(
            "tokenprobe_passthrough_requests",
            "Requests forwarded unmeasured (any method and path without an API seam), by "
            "bounded route template and HTTP status.",
            ("route", "code"),
            registry=registry,
        )
        self.key_requests = Counter(
            "tokenprobe_key_requests",
            "Measured requests by API key label (a short salted hash; with --key-label hash).",
            ("key", "model", "error_type"),
            registry=registry,
        )
        self.key_tokens = Counter(
            "tokenprobe_key_tokens",
            "Prompt and output tokens by API key label (with --key-label hash).",
            ("key", "model", "kind"),
            registry=registry,
        )
        self._children: dict[tuple[str, str], tuple[Any, ...]] = {}

    def _bound(self, model: str, endpoint: str) -> tuple[Any, ...]:
        """Label children for one (model, endpoint), resolved once and cached."""
        key = (model, endpoint)
        children = self._children.get(key)
        if children is None:
            children = tuple(
                m.labels(model, endpoint)
                for m in (
                    self.ttfb,
                    self.ttft,
                    self.itl,
                    self.tpot,
                    self.decode_speed,
                    self.e2e,
                    self.prompt_tokens,
                    self.generation_tokens,
                    self.cached_prompt_tokens_total,
                )
            )
            self._children[key] = children
        return children

    def record_key(self, m: Measurement, model_label: str, key_label: str) -> None:
        error = m.error_type.value if m.error_type is not None else NONE_LABEL
        self.key_requests.labels(key_label, model_label, error).inc()
        if m.prompt_tokens:
            self.key_tokens.labels(key_label, model_label, "prompt").inc(m.prompt_tokens)
        if m.output_tokens:
            self.key_tokens.labels(key_label, model_label, "output").inc(m.output_tokens)

    def record(self, m: Measurement, model_label: str) -> None:
        ttfb, ttft, itl, tpot, speed, e2e, prompt, generation, cached = self._bound(
            model_label, m.endpoint
        )
        exemplar = {"trace_id": m.trace_id} if m.trace_id else None
        if m.ttfb is not None:
            ttfb.observe(m.ttfb)
        if m.ttft is not None:
            ttft.observe(m.ttft, exemplar)
        observe_all(itl, m.inter_token_latencies)
        if m.tpot is not None:
            tpot.observe(m.tpot, exemplar)
        if m.decode_tokens_per_second is not None:
            speed.observe(m.decode_tokens_per_second)
        e2e.observe(m.e2e, exemplar)
        source = m.token_source.value
        if m.prompt_tokens is not None:
            prompt.observe(m.prompt_tokens)
            self.prompt_tokens_total.labels(model_label, m.endpoint, source).inc(m.prompt_tokens)
        if m.output_tokens is not None:
            generation.observe(m.output_tokens)
            self.generation_tokens_total.labels(model_label, m.endpoint, source).inc(
                m.output_tokens
            )
        if m.cached_prompt_tokens:
            cached.inc(m.cached_prompt_tokens)
        error = m.error_type.value if m.error_type is not None else NONE_LABEL
        reason = m.finish_reason if m.finish_reason in FINISH_REASONS else "other"
        self.requests.labels(model_label, m.endpoint, str(m.status_code), reason, error).inc()


def observe_all(histogram: Any, values: Sequence[float]) -> None:
    """Observe every value, with one increment per bucket touched instead of two per value.

    A stream's inter-token latencies are tens to thousands of values that mostly land in
    one or two buckets. prometheus-client has no bulk observe, so this counts them against
    the child's own bucket bounds (what `observe` does one value at a time) and adds each
    count once; the exposed histogram is the same.
    """
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None:  # a prometheus-client without them
        for value in values:
            histogram.observe(value)
        return
    counts = [0] * len(bounds)
    for value in values:
        counts[bisect_left(bounds, value)] += 1  # the first bound >= value, as observe does
    for bucket, count in zip(buckets, counts, strict=True):
        if count:
            bucket.inc(count)
    if values:
        total.inc(sum(values))


def _factory(kind: Any, registry: CollectorRegistry) -> Any:
    def make(name: str, doc: str, labels: tuple[str, ...] = (), **kw: Any) -> Any:
        return kind(name, doc, (*LABELS, *labels), registry=registry, **kw)

    return make
