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
from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from proxy.core.buckets import (
    DECODE_SPEED_BUCKETS,
    E2E_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    TTFB_BUCKETS,
    TTFT_BUCKETS,
    token_buckets,
)
from proxy.core.measurement import NONE_LABEL, Measurement
from proxy.sinks.sink import Labels

LABELS = ("model", "endpoint")

# TTFT by prompt size and cache. Prompt classes end at common context sizes (1k, 4k, 8k,
# 32k and 128k tokens): the first holds chat turns, the last long-context work.
PROMPT_CLASS_BOUNDS = (1024, 4096, 8192, 32768, 131072)
PROMPT_CLASSES = ("0-1k", "1k-4k", "4k-8k", "8k-32k", "32k-128k", "128k+", "unknown")
#: Cache classes by the share of prompt tokens served from the prefix cache:
#: none (0), part (below CACHE_MOST), most (CACHE_MOST or more), unknown (not reported).
CACHE_CLASSES = ("none", "part", "most", "unknown")
CACHE_MOST = 0.5
# A subset of TTFT_BUCKETS: the classes multiply the series, so fewer, wider buckets.
TTFT_CLASS_BUCKETS = (0.01, 0.02, 0.04, 0.06, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


def prompt_class(prompt_tokens: int | None) -> str:
    """The PROMPT_CLASSES label of a prompt: each class holds prompts up to its bound."""
    if prompt_tokens is None:
        return "unknown"
    return PROMPT_CLASSES[bisect_left(PROMPT_CLASS_BOUNDS, prompt_tokens)]


def cache_class(prompt_tokens: int | None, cached_tokens: int | None) -> str:
    """The CACHE_CLASSES label: how much of the prompt the backend said it had cached."""
    if cached_tokens is None or not prompt_tokens:
        return "unknown"
    if cached_tokens <= 0:
        return "none"
    return "most" if cached_tokens >= CACHE_MOST * prompt_tokens else "part"


class Metrics:
    """All of tokenprobe's Prometheus metrics, registered on one registry; a Sink.

    `record` observes one finished request, per-key counters included when the request
    has a key label; the dispatcher (proxy/sinks/dispatch.py) also moves the in-flight
    gauge and counts passthrough requests and measurement failures here."""

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
        self.ttft_by_prompt = h(
            "tokenprobe_time_to_first_token_by_prompt_seconds",
            "Time to first token as tokenprobe_time_to_first_token_seconds (proxy received the "
            "request -> first read carrying generated content), split by prompt size class "
            "(prompt tokens up to 1k, 4k, 8k, 32k, 128k, above; unknown) and prefix-cache class "
            "(cached prompt tokens: none, part = under half, most = half or more; unknown).",
            labels=("prompt_class", "cache_class"),
            buckets=TTFT_CLASS_BUCKETS,
        )
        self.ttft_prompt_tokens = c(
            "tokenprobe_time_to_first_token_by_prompt_prompt_tokens",
            "Prompt tokens of the requests in tokenprobe_time_to_first_token_by_prompt_seconds, "
            "by the same classes. Its rate over that histogram's _sum rate is the implied "
            "prefill rate: prompt tokens per second of TTFT.",
            labels=("prompt_class", "cache_class"),
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
        # Every metric labelled by (model, endpoint) alone: their children are resolved
        # once per pair (`_bound`), so a new one is its declaration above and one line in
        # `record`, nothing to keep in step by hand.
        self._per_pair = {
            name: metric
            for name, metric in vars(self).items()
            if isinstance(metric, MetricWrapperBase) and metric._labelnames == LABELS
        }
        self._children: dict[tuple[str, str], SimpleNamespace] = {}
        self._class_children: dict[tuple[str, str, str, str], tuple[Any, Any]] = {}

    def _bound(self, model: str, endpoint: str) -> SimpleNamespace:
        """This pair's children, as attributes named like the metrics (`.ttft`, ...)."""
        key = (model, endpoint)
        children = self._children.get(key)
        if children is None:
            children = SimpleNamespace(
                **{name: metric.labels(model, endpoint) for name, metric in self._per_pair.items()}
            )
            self._children[key] = children
        return children

    def _record_ttft_class(self, m: Measurement, model_label: str, ttft: float) -> None:
        """TTFT by prompt and cache class; label children resolved once per combination."""
        key = (
            model_label,
            m.endpoint,
            prompt_class(m.prompt_tokens),
            cache_class(m.prompt_tokens, m.cached_prompt_tokens),
        )
        children = self._class_children.get(key)
        if children is None:
            children = (self.ttft_by_prompt.labels(*key), self.ttft_prompt_tokens.labels(*key))
            self._class_children[key] = children
        histogram, prompt = children
        histogram.observe(ttft)
        if m.prompt_tokens:
            prompt.inc(m.prompt_tokens)

    def record(self, m: Measurement, labels: Labels) -> None:
        model_label = labels.model
        bound = self._bound(model_label, m.endpoint)
        exemplar = {"trace_id": m.trace_id} if m.trace_id else None
        if m.ttfb is not None:
            bound.ttfb.observe(m.ttfb)
        if m.ttft is not None:
            bound.ttft.observe(m.ttft, exemplar)
            self._record_ttft_class(m, model_label, m.ttft)
        observe_all(bound.itl, m.inter_token_latencies)
        if m.tpot is not None:
            bound.tpot.observe(m.tpot, exemplar)
        if m.decode_tokens_per_second is not None:
            bound.decode_speed.observe(m.decode_tokens_per_second)
        bound.e2e.observe(m.e2e, exemplar)
        source = m.token_source.value
        if m.prompt_tokens is not None:
            bound.prompt_tokens.observe(m.prompt_tokens)
            self.prompt_tokens_total.labels(model_label, m.endpoint, source).inc(m.prompt_tokens)
        if m.output_tokens is not None:
            bound.generation_tokens.observe(m.output_tokens)
            self.generation_tokens_total.labels(model_label, m.endpoint, source).inc(
                m.output_tokens
            )
        if m.cached_prompt_tokens:
            bound.cached_prompt_tokens_total.inc(m.cached_prompt_tokens)
        error = m.error_type.value if m.error_type is not None else NONE_LABEL
        # finish_reason is already the closed-set label (each Api maps raw values onto it).
        self.requests.labels(
            model_label, m.endpoint, str(m.status_code), m.finish_reason, error
        ).inc()
        if labels.key is not None:
            self._record_key(m, model_label, labels.key, error)

    def _record_key(self, m: Measurement, model_label: str, key_label: str, error: str) -> None:
        self.key_requests.labels(key_label, model_label, error).inc()
        if m.prompt_tokens:
            self.key_tokens.labels(key_label, model_label, "prompt").inc(m.prompt_tokens)
        if m.output_tokens:
            self.key_tokens.labels(key_label, model_label, "output").inc(m.output_tokens)


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
