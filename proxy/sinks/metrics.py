"""The Prometheus sink: one Measurement in, a handful of observations out.

Names mirror vLLM's own metrics with the `tokenprobe_` prefix and keep every one of vLLM's
bucket boundaries (with finer ones where the figures sit: proxy/core/buckets.py), so a
dashboard can put client-seen and server-side figures side by side.
Labels come from closed sets only: the model label is bounded by `ModelLabels`, the
endpoint is one Api's canonical path (proxy/core/apis ENDPOINTS), finish reasons are
mapped onto FINISH_LABELS by each Api, error types and token sources are enums.
Non-generative APIs (embeddings, pooling, score, rerank, classify) observe only e2e
latency, time to first byte, prompt tokens and the request counter.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from proxy.core.background import LateTokens
from proxy.core.buckets import (
    ACCEPTANCE_LENGTH_BUCKETS,
    DECODE_SPEED_BUCKETS,
    E2E_BUCKETS,
    OVERHEAD_BUCKETS,
    QUEUE_TIME_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    TOKENS_PER_CHUNK_BUCKETS,
    TTFB_BUCKETS,
    TTFT_BUCKETS,
    WS_SESSION_BUCKETS,
    bucket_counts,
    token_buckets,
)
from proxy.core.engine import EngineMetrics
from proxy.core.measurement import NONE_LABEL, Measurement
from proxy.core.wsrecord import WS_OUTCOMES, WsSessionRecord
from proxy.core.wsseam import seam_of
from proxy.sinks.sink import Labels

LABELS = ("model", "endpoint")

#: (code, finish_reason, error_type) of the outcomes that alerts, recording rules and panels
#: rate over: a pair's series of them exist at 0 from its first request, since rate() and
#: increase() read nothing of a burst in a series that first appears already above 0 (a
#: review: an upstream outage's 30 502s, first scraped at 30, never fired
#: TokenprobeUpstreamUnreachable). The codes are those the proxy answers with
#: (proxy/core/errors.py _STATUS_FOR_ERROR: 502 unreachable, 502 upstream error, 504
#: timeout) and vLLM's for the rest (400 context length, 401 auth, 404 unknown model, 429
#: from a gateway, 500 an engine error); another code for one makes its series at its first
#: error, as every other outcome does. With a pair's success: 11 series for a pooling pair,
#: 14 for a generative one (GENERATIVE_FIRST_COUNTED); 3 before the outage review.
FIRST_COUNTED = (
    ("401", NONE_LABEL, "auth"),
    ("403", NONE_LABEL, "auth"),
    ("400", NONE_LABEL, "context_length"),
    ("400", NONE_LABEL, "bad_request"),
    ("404", NONE_LABEL, "not_found"),
    ("429", NONE_LABEL, "rate_limit"),
    ("500", NONE_LABEL, "upstream_error"),
    ("502", NONE_LABEL, "upstream_error"),
    ("502", NONE_LABEL, "upstream_unreachable"),
    ("504", NONE_LABEL, "upstream_timeout"),
)
#: What a generative pair adds: the successes the ratios divide by (stop) and count
#: (length: the truncation ratio), and the failures inside a 200 stream.
GENERATIVE_FIRST_COUNTED = (
    ("200", "stop", NONE_LABEL),
    ("200", "length", NONE_LABEL),
    ("200", NONE_LABEL, "stream_error"),
    ("200", NONE_LABEL, "stream_truncated"),
)
#: A non-generative pair's success (an embedding has no finish_reason).
POOLING_FIRST_COUNTED = (("200", NONE_LABEL, NONE_LABEL),)


def first_counted(endpoint: str) -> tuple[tuple[str, str, str], ...]:
    """The (code, finish_reason, error_type) series a pair of this endpoint starts with at 0
    (an endpoint no API claims, which records never carry, only the common ones)."""
    try:
        generative = seam_of(endpoint).generative
    except KeyError:
        return FIRST_COUNTED
    return FIRST_COUNTED + (GENERATIVE_FIRST_COUNTED if generative else POOLING_FIRST_COUNTED)


# TTFT by prompt size and cache. Prompt classes end at common context sizes (1k, 4k, 8k,
# 32k and 128k tokens): the first holds chat turns, the last long-context work.
PROMPT_CLASS_BOUNDS = (1024, 4096, 8192, 32768, 131072)
PROMPT_CLASSES = ("0-1k", "1k-4k", "4k-8k", "8k-32k", "32k-128k", "128k+", "unknown")
#: Cache classes by the share of prompt tokens served from the prefix cache:
#: none (0), part (below CACHE_MOST), most (CACHE_MOST or more), unknown (not reported).
CACHE_CLASSES = ("none", "part", "most", "unknown")
CACHE_MOST = 0.5
# Conversations: a tool's or a user's time between turns (tens of ms to half an hour), the
# requests per conversation, a continuation's cached share of the prefix it repeats.
TURN_GAP_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
)
TURNS_BUCKETS = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 15.0, 20.0, 30.0, 50.0, 100.0, 200.0)
CACHED_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
# A subset of TTFT_BUCKETS: the classes multiply the series, so fewer, wider buckets.
#: The answer's share of a reasoning stream's output, and tool calls per answer (issue 26).
SHARE_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
CALLS_BUCKETS = (1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0, 64.0)
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


#: The token counters' words on background Responses (proxy/core/background.py).
LATE = (
    " A background Response (background: true) whose POST's answer ended before it did "
    "(not streamed, or its client left) is counted when a GET /v1/responses/{id} through "
    "the same proxy process first sees it finished, with the POST's labels."
)


class Metrics:
    """All of tokenprobe's Prometheus metrics, registered on one registry; a Sink.

    `record` observes one finished request, per-key counters included when the request
    has a key label; the dispatcher (proxy/sinks/dispatch.py) also moves the in-flight
    gauge and counts passthrough requests and measurement failures here."""

    def __init__(self, registry: CollectorRegistry, attribution: tuple[str, ...] = ()) -> None:
        """`attribution`: the --label-header label names, added after model and endpoint
        to the request and token counters and the latency histograms."""
        self.registry = registry
        self.attribution = attribution
        h = _factory(Histogram, registry, attribution)
        c = _factory(Counter, registry, attribution)
        # (model, endpoint) and their own labels only: the prompt/cache classes and the
        # engine's figures already multiply their series, attribution labels would more.
        h_bare = _factory(Histogram, registry)
        c_bare = _factory(Counter, registry)
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
        self.ttft_by_prompt = h_bare(
            "tokenprobe_time_to_first_token_by_prompt_seconds",
            "Time to first token as tokenprobe_time_to_first_token_seconds (proxy received the "
            "request -> first read carrying generated content), split by prompt size class "
            "(prompt tokens up to 1k, 4k, 8k, 32k, 128k, above; unknown) and prefix-cache class "
            "(cached prompt tokens: none, part = under half, most = half or more; unknown).",
            labels=("prompt_class", "cache_class"),
            buckets=TTFT_CLASS_BUCKETS,
        )
        self.ttft_prompt_tokens = c_bare(
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
            "streamed requests with at least 2 output tokens over more than one read (a "
            "non-streamed answer, or a stream that came in one read, has no time between its "
            "tokens); with n > 1 choices, the median choice's.",
            buckets=TOKEN_LATENCY_BUCKETS,
        )
        self.decode_speed = h(
            "tokenprobe_request_decode_tokens_per_second",
            "Per request single-stream generation speed: (output tokens - 1) / (last token "
            "time - first token time); streamed requests with at least 2 output tokens over "
            "more than one read. Not aggregate throughput.",
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
            "Prompt tokens per request: from the backend's usage, else its engine's own "
            "account (llama.cpp timings), else the tokenizer or the token ids sent "
            "(tokenprobe_prompt_tokens_total's source label says which).",
            buckets=token_buckets(),
        )
        self.generation_tokens = h(
            "tokenprobe_request_generation_tokens",
            "Output tokens per request: from the backend's usage, else its engine's own "
            "account (llama.cpp timings), else the tokenizer or the token ids streamed, else "
            "content events (tokenprobe_generation_tokens_total's source label says which).",
            buckets=token_buckets(),
        )
        self.requests = c(
            "tokenprobe_requests",
            "Measured requests finished, by HTTP status the client got, finish_reason mapped "
            "onto one closed set across APIs (Anthropic max_tokens and Responses "
            "max_output_tokens are 'length'; 'none' if absent) and error type ('none' on "
            "success). A (model, endpoint)'s first request makes the outcomes the shipped "
            "alerts and rules rate over at 0 (success, truncation, each upstream failure, "
            "auth, context length, rate limit, not found, bad request), so a later burst is "
            "all in rate(); what a pair counted before Prometheus first scraped it is not, "
            "and a failure that goes on is seen from the next scrape. To catch a one-off "
            "burst in a new pair, alert also on `X > 0 unless X offset 15m` as "
            "TokenprobeWorkerRequestsLost does.",
            labels=("code", "finish_reason", "error_type"),
        )
        self.prompt_tokens_total = c(
            "tokenprobe_prompt_tokens",
            "Prompt tokens of finished requests, by where the count came from." + LATE,
            labels=("source",),
        )
        self.generation_tokens_total = c(
            "tokenprobe_generation_tokens",
            "Output tokens of finished requests, by where the count came from." + LATE,
            labels=("source",),
        )
        self.cached_prompt_tokens_total = c(
            "tokenprobe_cached_prompt_tokens",
            "Prompt tokens served from the backend's prefix cache "
            "(usage.prompt_tokens_details.cached_tokens)." + LATE,
        )
        self.cache_write_prompt_tokens_total = c(
            "tokenprobe_cache_write_prompt_tokens",
            "Prompt tokens the backend computed and wrote to its prefix cache, as its usage "
            "reports them (vLLM with --enable-prompt-tokens-details: chat "
            "usage.prompt_tokens_details.created_cache_tokens, OpenAI's cache_write_tokens "
            "there, Responses "
            "usage.input_tokens_details.cache_write_tokens, Messages "
            "usage.cache_creation_input_tokens; legacy completions report none)." + LATE,
        )
        self.audio_seconds_total = c(
            "tokenprobe_audio_input_seconds",
            "Seconds of audio clients sent to be transcribed, counted when each utterance's "
            "record ends (from its commit to its transcription.done, error or cut): the "
            "base64-decoded bytes of its input_audio_buffer.append events over 32000 "
            "(PCM16, 16 kHz, mono), as vLLM decodes them (characters outside the base64 "
            "alphabet dropped; an append it refuses as invalid_audio, which decodes to "
            "nothing, to an odd number of bytes or with bad padding, counts none). Divide "
            "the e2e seconds by it for the real-time factor.",
        )
        self.in_flight = Gauge(
            "tokenprobe_requests_in_flight",
            "Measured requests from their body having been read (the model known: a "
            "request still sending its body is not counted yet, though its e2e runs from "
            "its head's arrival) to their last byte.",
            LABELS,
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.requests_lost = Counter(
            "tokenprobe_requests_lost",
            "Measured requests in flight on a `--workers` process that died (killed, out of "
            "memory, crashed) between their body having been read and their last byte: their "
            "clients' connections were cut and no record was written, so no other series "
            "counts them. Counted at the first scrape after the death; each (model, "
            "endpoint) series is exported at 0 from its first request on.",
            LABELS,
            registry=registry,
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
            "Measured requests by API key label, with --key-label hash: a short salted hash "
            "for each of the first 100 keys the backend accepted; `rejected` for a key it "
            "refused (401/403), `other` once those are taken or with no answer, `none` "
            "without a key.",
            ("key", "model", "error_type"),
            registry=registry,
        )
        self.key_tokens = Counter(
            "tokenprobe_key_tokens",
            "Prompt and output tokens by API key label (with --key-label hash)." + LATE,
            ("key", "model", "kind"),
            registry=registry,
        )
        self.proxy_overhead = h(
            "tokenprobe_proxy_overhead_seconds",
            "The proxy's own time per request: from its body being read to the request "
            "being handed to the upstream connection, plus from the upstream's response "
            "head arriving to that head being sent to the client.",
            buckets=OVERHEAD_BUCKETS,
        )
        declared = set(vars(self))
        self._kinds_metrics(h, c)
        # Figures only some streams have (reasoning, tool calls): their children are made on
        # first use, so plain traffic exports no empty histograms and every scrape renders
        # only the series that exist (`_LazyChildren`).
        self._kinds = {name: vars(self)[name] for name in set(vars(self)) - declared}
        self._kind_children: dict[tuple[str, ...], _LazyChildren] = {}
        self.upstream_protocol = UpstreamProtocolErrors(registry)
        self.tls_reloads = TlsReloads(registry)
        # Every metric labelled by (model, endpoint, *attribution) alone: their children are
        # resolved once per key (`_bound`), so a new one is its declaration above and one
        # line in `record`, nothing to keep in step by hand.
        per_request = (*LABELS, *attribution)
        self._per_pair = {
            name: metric
            for name, metric in vars(self).items()
            if isinstance(metric, MetricWrapperBase)
            and metric._labelnames == per_request
            and name not in self._kinds
        }
        self._children: dict[tuple[str, ...], SimpleNamespace] = {}
        self._labelled: dict[tuple[Any, ...], Any] = {}  # `child`'s cache
        self._class_children: dict[tuple[str, str, str, str], tuple[Any, Any]] = {}
        self._engine_metrics(h_bare, c_bare)
        self._engine_children: dict[tuple[str, str, bool], tuple[Any, ...]] = {}
        self._conversation_metrics(registry)
        self._backend_metrics(h_bare, c_bare)
        self.ws = WsMetrics(registry)  # WebSocket sessions, counted by `session`

    # -- issue 26: first tokens by kind, tokens by kind, tool calls ------------------------

    def _kinds_metrics(self, h: Any, c: Any) -> None:
        """Reasoning, answers and tool calls (proxy/core/observe.py, toolcalls.py)."""
        self.ttfa = h(
            "tokenprobe_time_to_first_answer_token_seconds",
            "Client-seen time to first answer token: from the proxy receiving the request to "
            "the first network read carrying answer content (chat delta.content, Messages "
            "text_delta, Responses output_text.delta, Cohere text, completions text), not "
            "reasoning nor tool calls: what a chat user waits for. Streams with an answer.",
            buckets=TTFT_BUCKETS,
        )
        self.ttfr = h(
            "tokenprobe_time_to_first_reasoning_token_seconds",
            "Client-seen time to first reasoning token: from the proxy receiving the request "
            "to the first network read carrying reasoning (chat delta.reasoning or "
            "reasoning_content, Messages thinking_delta, Responses reasoning_text.delta, "
            "Cohere thinking). Streams that reasoned.",
            buckets=TTFT_BUCKETS,
        )
        self.reasoning_duration = h(
            "tokenprobe_reasoning_duration_seconds",
            "How long a stream reasoned: from the first network read carrying reasoning to "
            "the last one. Streams that reasoned.",
            buckets=TTFT_BUCKETS,
        )
        self.ttftc = h(
            "tokenprobe_time_to_first_tool_call_seconds",
            "Client-seen time to first tool call: from the proxy receiving the request to "
            "the network read carrying the first tool call's first delta (chat "
            "delta.tool_calls with id/name, Messages tool_use content_block_start, Responses "
            "function_call output_item.added, Cohere tool-call-start). Streams with calls.",
            buckets=TTFT_BUCKETS,
        )
        self.reasoning_tokens_total = c(
            "tokenprobe_reasoning_tokens",
            "Reasoning tokens of finished streams and whole answers, by source: usage (the "
            "backend's "
            "completion_tokens_details / output_tokens_details reasoning_tokens, when above "
            "0 and not contradicted by the stream's event counts), output (all the output "
            "tokens of a stream that carried reasoning only), tokenizer (--tokenizer over "
            "the reasoning text), events (one per reasoning event). vLLM counts only tokens "
            "between a generated <think> and </think>." + LATE,
            labels=("source",),
        )
        self.answer_share = h(
            "tokenprobe_request_answer_token_share",
            "Per stream that reasoned: the answer's share of its output tokens, (output "
            "tokens - reasoning tokens) / output tokens, both counted at the stream's end.",
            buckets=SHARE_BUCKETS,
        )
        self.reasoning_tpot = h(
            "tokenprobe_request_reasoning_time_per_output_token_seconds",
            "Per stream: (last reasoning read - first reasoning read) / (reasoning tokens - "
            "1); streams with at least 2 reasoning tokens.",
            buckets=TOKEN_LATENCY_BUCKETS,
        )
        self.answer_tpot = h(
            "tokenprobe_request_answer_time_per_output_token_seconds",
            "Per stream that reasoned: (last answer read - first answer read) / (output - "
            "reasoning tokens - 1); streams with at least 2 answer tokens and no tool call.",
            buckets=TOKEN_LATENCY_BUCKETS,
        )
        self.without_answer = c(
            "tokenprobe_requests_without_answer",
            "Generative requests that generated output but delivered no answer token and no "
            "tool call to the client (only reasoned, or a forced call cut off before its "
            "first delta; a body not streamed: reasoning alone), counted at the answer's "
            "end, by how it ended: length, stop, error, cancelled.",
            labels=("reason",),
        )
        self.tool_calls_total = c(
            "tokenprobe_tool_calls",
            "Tool calls the client received, counted at the stream's end (a whole answer: from "
            "its body), by outcome: "
            "truncated (still being written when the stream ended: the last call of a "
            "length finish, or an open call of a stream cut short), unknown (arguments over "
            "1 MiB, not kept), invalid_arguments (not a JSON object), complete.",
            labels=("outcome",),
        )
        self.tool_call_arguments = h(
            "tokenprobe_tool_call_arguments_seconds",
            "Per tool call: from the read carrying its first delta to the read carrying its "
            "last argument piece (or the API's end of the call).",
            buckets=TTFT_BUCKETS,
        )
        self.tool_calls_per_answer = h(
            "tokenprobe_tool_calls_per_answer",
            "Per answer (a stream, or a whole body) that made tool calls: how many calls it made.",
            buckets=CALLS_BUCKETS,
        )

    def _record_kinds(self, m: Measurement, key: tuple[str, ...], bound: Any) -> None:
        """Only streams with reasoning, an answer or tool calls get here, and whole answers
        with calls or reasoning tokens."""
        if m.first_answer is not None:
            bound.ttfa.observe(m.first_answer)
        if m.first_reasoning is not None:
            bound.ttfr.observe(m.first_reasoning)
            duration = m.reasoning_duration
            if duration is not None:
                bound.reasoning_duration.observe(duration)
            answer = m.answer_tokens
            if answer is not None and m.output_tokens:
                bound.answer_share.observe(answer / m.output_tokens)
        if m.reasoning_tokens and m.reasoning_token_source is not None:
            self.reasoning_tokens_total.labels(*key, m.reasoning_token_source).inc(
                m.reasoning_tokens
            )
        if m.reasoning_tpot is not None:
            bound.reasoning_tpot.observe(m.reasoning_tpot)
        if m.answer_tpot is not None:
            bound.answer_tpot.observe(m.answer_tpot)
        if m.without_answer is not None:
            self.without_answer.labels(*key, m.without_answer).inc()
        if m.first_tool_call is not None:
            bound.ttftc.observe(m.first_tool_call)
        if m.tool_calls:
            bound.tool_calls_per_answer.observe(len(m.tool_calls))
            for outcome, count in m.tool_call_outcomes().items():
                self.tool_calls_total.labels(*key, outcome).inc(count)
            for call in m.tool_calls:
                if call.arguments_seconds is not None:
                    bound.tool_call_arguments.observe(call.arguments_seconds)

    def _engine_metrics(self, h: Any, c: Any) -> None:
        """Where the first token's time goes, speculative decoding, cancelled work and the
        event loop's lag (proxy/core/engine.py reads the engine's object). Declared apart
        from the per-pair metrics: only the requests that have these figures resolve their
        children, so a backend without the engine's object leaves the series absent."""
        self.engine_queue = h(
            "tokenprobe_engine_queue_time_seconds",
            "The engine's own queue time (vLLM per-request metrics queue_time_ms): from the "
            "request entering the engine's waiting queue to its first scheduling. Streams: "
            "the part of client-seen TTFT tokenprobe_time_to_first_token_outside_engine_seconds "
            "explains (scaled with the engine TTFT when both exceed the client-seen TTFT). "
            "`stream` says whether the answer was streamed.",
            labels=("stream",),
            buckets=QUEUE_TIME_BUCKETS,
        )
        self.engine_ttft = h(
            "tokenprobe_engine_time_to_first_token_seconds",
            "The engine's own time to first token: vLLM per-request metrics "
            "time_to_first_token_ms, from the request's scheduling to its first token; "
            "llama.cpp timings.prompt_ms, from its slot starting on the prompt to the "
            "prompt's last batch, whose logits give the first token. "
            "Streams: scaled with the queue time when both exceed the client-seen TTFT.",
            labels=("stream",),
            buckets=TTFT_BUCKETS,
        )
        self.outside_engine = h(
            "tokenprobe_time_to_first_token_outside_engine_seconds",
            "Client-seen TTFT (proxy received the request -> first read carrying content) "
            "minus the engine's queue time (or, from Ollama, its model load time, "
            "tokenprobe_engine_load_time_seconds) minus the engine's TTFT, never below 0: network, "
            "HTTP and tokenisation in the server's front end, and the proxy (and the wait for "
            "a slot where the engine reports no queue time: llama.cpp). Streams that "
            "carried the engine's per-request metrics; for them the _sum of this, of "
            'tokenprobe_engine_queue_time_seconds{stream="true"} and of '
            'tokenprobe_engine_time_to_first_token_seconds{stream="true"} add up to their TTFT sum.',
            buckets=TTFB_BUCKETS,
        )
        self.tokens_per_chunk = h(
            "tokenprobe_request_output_tokens_per_chunk",
            "Per stream: output tokens (usage, engine, token ids or tokenizer) / content events, from the first "
            "to the last event. Above 1 under speculative decoding or multi-token prediction, "
            "which is why inter-chunk latency is not per-token latency.",
            buckets=TOKENS_PER_CHUNK_BUCKETS,
        )
        self.spec_draft = c(
            "tokenprobe_spec_decode_draft_tokens",
            "Draft tokens the engine proposed (vLLM per-request metrics "
            "speculative_decoding.num_draft_tokens) from each request's first verify step to "
            "its last, summed over finished requests.",
        )
        self.spec_accepted = c(
            "tokenprobe_spec_decode_accepted_tokens",
            "Draft tokens the target model accepted (speculative_decoding."
            "num_accepted_draft_tokens) from each request's first verify step to its last, "
            "summed over finished requests.",
        )
        self.spec_acceptance_length = h(
            "tokenprobe_spec_decode_mean_acceptance_length",
            "Per request: the engine's mean acceptance length (speculative_decoding."
            "mean_acceptance_length), tokens per verify step, from the request's first to "
            "its last step.",
            buckets=ACCEPTANCE_LENGTH_BUCKETS,
        )
        self.cancelled_prompt = c(
            "tokenprobe_cancelled_prompt_tokens",
            "Prompt tokens of requests whose client went away before the end (from the "
            "proxy receiving the request to the client's disconnect): the prefill nobody "
            "received. Needs usage or a tokenizer (`source`).",
            labels=("source",),
        )
        self.cancelled_generation = c(
            "tokenprobe_cancelled_generation_tokens",
            "Output tokens the proxy saw for requests whose client went away before the end "
            "(first content read to the disconnect), by where the count came from.",
            labels=("source",),
        )
        self.loop_lag = Histogram(
            "tokenprobe_event_loop_lag_seconds",
            "How late the proxy's event loop woke a sampler: from the instant a periodic "
            "sleep should have ended to the instant it did (every request on that loop "
            "waits as long).",
            registry=self.registry,
            buckets=OVERHEAD_BUCKETS,
        )

    def _conversation_metrics(self, registry: CollectorRegistry) -> None:
        """Conversations (proxy/core/conversations.py): observed by the conversation tracker
        (proxy/sinks/conversations.py), per continuation at its end and per conversation
        when it goes idle. Labels: model and how a continuation was recognised (`via`:
        header, previous_response, messages), both closed sets."""
        self.conversation_continuations = Counter(
            "tokenprobe_conversation_continuations",
            "Measured requests that continue an earlier one's conversation, by how that was "
            "recognised (via: the conversation header, previous_response_id, or leading "
            "messages equal to all of an earlier request's).",
            ("model", "via"),
            registry=registry,
        )
        self.conversation_turn_gap = Histogram(
            "tokenprobe_conversation_turn_gap_seconds",
            "Time between a conversation's turns, outside the model (the tool's or the "
            "user's time): from the end of the previous request's response (its last byte "
            "relayed) to the proxy receiving the continuation. Not observed while the "
            "previous request is still in flight.",
            ("model", "via"),
            registry=registry,
            buckets=TURN_GAP_BUCKETS,
        )
        self.continuation_cached_ratio = Histogram(
            "tokenprobe_continuation_cached_prompt_ratio",
            "A continuation's cached prompt tokens as its backend reported them, over the "
            "tokens of the earlier prompt it repeats (the earlier request's prompt tokens, with "
            "previous_response_id too: vLLM puts back only the answer's text), at most 1. "
            "Only when "
            "the backend reports cached tokens (vLLM: --enable-prompt-tokens-details).",
            ("model",),
            registry=registry,
            buckets=CACHED_RATIO_BUCKETS,
        )
        self.continuation_cache_misses = Counter(
            "tokenprobe_continuation_cache_misses",
            "Continuations whose cached prompt tokens cover less than "
            "--continuation-cache-miss-ratio of the prompt they repeat: a prefix the "
            "backend recomputed (another replica, an evicted cache).",
            ("model",),
            registry=registry,
        )
        self.conversation_turns = Histogram(
            "tokenprobe_conversation_turns",
            "Requests per conversation, observed when it ends: --conversation-idle seconds "
            "after its last request's end (a single request is a conversation of one turn).",
            registry=registry,
            buckets=TURNS_BUCKETS,
        )
        self.conversation_duration = Histogram(
            "tokenprobe_conversation_duration_seconds",
            "A conversation's length, observed when it ends: from the proxy receiving its "
            "first request to the end of its last request's response.",
            registry=registry,
            buckets=WS_SESSION_BUCKETS,
        )
        self.conversation_model_time = Histogram(
            "tokenprobe_conversation_model_seconds",
            "A conversation's time in the model, observed when it ends: the sum over its "
            "requests of the proxy receiving each to the end of its response.",
            registry=registry,
            buckets=WS_SESSION_BUCKETS,
        )
        self.conversation_between_time = Histogram(
            "tokenprobe_conversation_between_requests_seconds",
            "A conversation's time between requests, observed when it ends: the sum of its "
            "turn gaps (each previous response's end to the next request's receipt).",
            registry=registry,
            buckets=WS_SESSION_BUCKETS,
        )
        self.conversations_open = Gauge(
            "tokenprobe_conversations_open",
            "Conversations the proxy remembers now (bounded by --conversation-table).",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.conversation_evictions = Counter(
            "tokenprobe_conversation_evictions",
            "Conversations forgotten before going idle because the table was full (the one "
            "touched longest ago goes first); their later turns count as new conversations.",
            registry=registry,
        )
        self.conversation_header_refused = Counter(
            "tokenprobe_conversation_header_refused",
            "Requests whose --conversation-header value was not used, by reason: too_long "
            "(over 256 bytes) or not_text (not printable ASCII). The request is measured and "
            "recognised by its messages instead.",
            ("reason",),
            registry=registry,
        )

    def _bound(self, key: tuple[str, ...]) -> SimpleNamespace:
        """The children of one (model, endpoint, *attribution), as attributes named like
        the metrics (`.ttft`, ...). The first time, the request outcomes that alerts, rules
        and panels rate over are made too, at 0 (first_counted)."""
        children = self._children.get(key)
        if children is None:
            children = SimpleNamespace(
                **{name: metric.labels(*key) for name, metric in self._per_pair.items()}
            )
            self._children[key] = children
            for outcome in first_counted(key[1]):
                self.child(self.requests, *key, *outcome)
        return children

    def child(self, metric: Any, *values: str) -> Any:
        """`metric.labels(*values)`, resolved once per label values: `labels` takes a lock,
        checks and converts every value (about 1.3 µs against 0.35 for this lookup). The
        values come from closed sets, so this holds no more entries than the registry."""
        key = (metric, *values)
        child = self._labelled.get(key)
        if child is None:
            child = self._labelled[key] = metric.labels(*values)
        return child

    def in_flight_of(self, model: str, endpoint: str) -> Any:
        """The in-flight gauge's child of a (model, endpoint); the first time a pair is
        seen its `requests_lost` series is made too, at 0: an alert reads a loss as the
        counter's increase, which a series that first appears already at 1 never shows."""
        key = (self.in_flight, model, endpoint)
        child = self._labelled.get(key)
        if child is None:
            child = self._labelled[key] = self.in_flight.labels(model, endpoint)
            self.requests_lost.labels(model, endpoint)
        return child

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
        key = (model_label, m.endpoint, *labels.attribution)
        bound = self._bound(key)
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
            self.child(self.prompt_tokens_total, *key, source).inc(m.prompt_tokens)
        if m.output_tokens is not None:
            bound.generation_tokens.observe(m.output_tokens)
            self.child(self.generation_tokens_total, *key, source).inc(m.output_tokens)
        if m.cached_prompt_tokens:
            bound.cached_prompt_tokens_total.inc(m.cached_prompt_tokens)
        if m.cache_write_tokens:
            bound.cache_write_prompt_tokens_total.inc(m.cache_write_tokens)
        if m.audio_seconds:
            bound.audio_seconds_total.inc(m.audio_seconds)
        error = m.error_type.value if m.error_type is not None else NONE_LABEL
        # finish_reason is already the closed-set label (each Api maps raw values onto it).
        self.child(self.requests, *key, str(m.status_code), m.finish_reason, error).inc()
        if labels.key is not None:
            self._record_key(m, model_label, labels.key, error)
        if m.proxy_overhead is not None:
            bound.proxy_overhead.observe(m.proxy_overhead)
        if m.engine is not None:
            self._record_engine(m, model_label, m.engine)
        if m.malformed_events:
            self.malformed_events.labels(model_label, m.endpoint).inc(m.malformed_events)
        ratio = m.output_tokens_per_chunk()
        if ratio is not None:
            self.child(self.tokens_per_chunk, model_label, m.endpoint).observe(ratio)
        if m.cancelled:
            self._record_cancelled(m, model_label)
        # a stream's kinds, or a whole answer's calls and reasoning (its body's: the
        # record has them, docs/reasoning.md "Answers that are not streamed")
        if (
            (m.stream and m.content_events)
            or m.without_answer is not None
            or m.tool_calls
            or m.reasoning_tokens
        ):
            kinds = self._kind_children.get(key)
            if kinds is None:
                kinds = self._kind_children[key] = _LazyChildren(self._kinds, key)
            self._record_kinds(m, key, kinds)

    def late_tokens(self, t: LateTokens, labels: Labels) -> None:
        """A background Response's tokens, counted after its POST's record: the token
        counters only, with the POST's labels (no request, histogram or latency)."""
        model_label = labels.model
        key = (model_label, t.endpoint, *labels.attribution)
        source = t.token_source.value
        if t.prompt_tokens is not None:
            self.child(self.prompt_tokens_total, *key, source).inc(t.prompt_tokens)
        if t.output_tokens is not None:
            self.child(self.generation_tokens_total, *key, source).inc(t.output_tokens)
        if t.cached_prompt_tokens:
            self.child(self.cached_prompt_tokens_total, *key).inc(t.cached_prompt_tokens)
        if t.cache_write_tokens:
            self.child(self.cache_write_prompt_tokens_total, *key).inc(t.cache_write_tokens)
        if t.reasoning_tokens and t.reasoning_token_source is not None:
            self.reasoning_tokens_total.labels(*key, t.reasoning_token_source).inc(
                t.reasoning_tokens
            )
        if labels.key is not None:
            if t.prompt_tokens:
                self.key_tokens.labels(labels.key, model_label, "prompt").inc(t.prompt_tokens)
            if t.output_tokens:
                self.key_tokens.labels(labels.key, model_label, "output").inc(t.output_tokens)

    def session(self, record: WsSessionRecord) -> None:
        """One WebSocket session ended: its outcome counted, its duration observed (the
        in-flight gauge is the dispatcher's, as for requests)."""
        _, duration, outcomes = self.ws.for_route(record.route)
        outcomes[record.outcome].inc()
        duration.observe(record.duration)

    def _backend_metrics(self, h: Any, c: Any) -> None:
        """Issue 27: the model-load part of the first token's time (Ollama), and which
        backend and version answer (proxy/server/identity.py)."""
        self.engine_load = h(
            "tokenprobe_engine_load_time_seconds",
            "The engine's own time to have the model loaded before the request could run "
            "(Ollama load_duration: from its handler receiving the request to a loaded "
            "runner; a wait for a parallel slot, OLLAMA_NUM_PARALLEL, is not in it). Streams: scaled with the engine TTFT when "
            "both exceed the client-seen TTFT; for them the _sum of this, of "
            'tokenprobe_engine_time_to_first_token_seconds{stream="true"} and of '
            "tokenprobe_time_to_first_token_outside_engine_seconds add up to their TTFT sum. "
            "Absent for engines that serve a loaded model (vLLM).",
            labels=("stream",),
            buckets=QUEUE_TIME_BUCKETS,
        )
        self.backend_info = Gauge(
            "tokenprobe_backend_info",
            "1 for the backend kind and version the upstream last said it is (asked at "
            "start and every --models-refresh seconds (never when it is 0): vLLM /version, Ollama "
            "/api/version, llama.cpp /props, SGLang /get_server_info, TGI /info); "
            'kind="unknown" when none answered. One series at 1 at a time (with --workers '
            "an earlier backend's series stays, at 0).",
            ("kind", "version"),
            registry=self.registry,
            # every worker asks the same upstream; a dead worker's value is dropped
            multiprocess_mode="livemax",
        )
        self._backend: tuple[str, str] | None = None
        self.malformed_events = c(
            "tokenprobe_malformed_events",
            "Streamed events (an SSE data payload, an NDJSON line) that were not a JSON "
            "object, from a response's first byte to its last: skipped by the measuring, "
            "relayed to the client as they came.",
        )

    def set_backend(self, kind: str, version: str) -> None:
        """Which backend answers: the one series of tokenprobe_backend_info."""
        if self._backend == (kind, version):
            return
        if self._backend is not None:  # 0 first: a multiprocess file keeps the last value
            self.backend_info.labels(*self._backend).set(0)
            if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:  # it cannot remove one there
                self.backend_info.remove(*self._backend)
        self.backend_info.labels(kind, version).set(1)
        self._backend = (kind, version)

    def _record_engine(self, m: Measurement, model_label: str, engine: EngineMetrics) -> None:
        """The engine's figures: only requests that carried them touch these series, each
        (model, endpoint, stream) resolving its children once."""
        key = (model_label, m.endpoint, m.stream)
        children = self._engine_children.get(key)
        if children is None:
            stream = "true" if m.stream else "false"
            children = (
                self.engine_queue.labels(model_label, m.endpoint, stream),
                self.engine_ttft.labels(model_label, m.endpoint, stream),
                self.outside_engine.labels(model_label, m.endpoint),
            )
            self._engine_children[key] = children
        queue, first, outside = children
        split = m.ttft_split()
        loaded = None if split is not None else m.load_split()
        if split is not None:
            if split[0] is not None:  # llama.cpp reports no queue time
                queue.observe(split[0])
            first.observe(split[1])
            outside.observe(split[2])
        elif loaded is not None:  # model load, engine TTFT, outside (Ollama)
            self.engine_load.labels(model_label, m.endpoint, "true").observe(loaded[0])
            first.observe(loaded[1])
            outside.observe(loaded[2])
        elif not m.stream:  # no client TTFT to split: the engine's figures as they are
            if engine.queue_time is not None:
                queue.observe(engine.queue_time)
            if engine.time_to_first_token is not None:
                first.observe(engine.time_to_first_token)
            if engine.load_time is not None:
                self.engine_load.labels(model_label, m.endpoint, "false").observe(engine.load_time)
        if engine.invalid:  # llama.cpp timings that made no sense (proxy/core/llamacpp.py)
            self.measurement_failures.labels("engine_timings").inc()
        spec = engine.spec
        if spec is not None:
            self.spec_draft.labels(model_label, m.endpoint).inc(spec.draft_tokens)
            self.spec_accepted.labels(model_label, m.endpoint).inc(spec.accepted_tokens)
            if spec.mean_acceptance_length is not None:
                self.spec_acceptance_length.labels(model_label, m.endpoint).observe(
                    spec.mean_acceptance_length
                )

    def _record_cancelled(self, m: Measurement, model_label: str) -> None:
        source = m.token_source.value
        if m.prompt_tokens:
            self.cancelled_prompt.labels(model_label, m.endpoint, source).inc(m.prompt_tokens)
        if m.output_tokens:
            self.cancelled_generation.labels(model_label, m.endpoint, source).inc(m.output_tokens)

    def _record_key(self, m: Measurement, model_label: str, key_label: str, error: str) -> None:
        self.key_requests.labels(key_label, model_label, error).inc()
        if m.prompt_tokens:
            self.key_tokens.labels(key_label, model_label, "prompt").inc(m.prompt_tokens)
        if m.output_tokens:
            self.key_tokens.labels(key_label, model_label, "output").inc(m.output_tokens)


# -- the upstream's protocol errors (issue 32) ---------------------------------------------

#: What `tokenprobe_upstream_protocol_errors_total{kind}` counts, a closed set.
UPSTREAM_PROTOCOL_ERRORS = {
    "extra_bytes": "bytes after a response's end, before its connection was back in the "
    "pool (a second response, or part of one, in the read that ended the first), or after "
    "the end of a refused WebSocket handshake's answer",
    "idle_bytes": "bytes on a pooled connection that carried no request",
    "malformed": "a response head or body framing the parser refused (Content-Length and "
    "Transfer-Encoding together, a bad chunk size, a bad status line...)",
    "upgrade": "a 101 Switching Protocols (or another protocol switch) answering a request "
    "that asked for none",
}


class TlsReloads:
    """`tokenprobe_tls_reloads_total{outcome}`: --enable-ssl-refresh at work."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.counter = Counter(
            "tokenprobe_tls_reloads",
            "TLS contexts reloaded from files that changed on disk (--enable-ssl-refresh), "
            "counted when the check that saw the change ran, by outcome (loaded: new "
            "connections use the new files; failed: the files did not load together, the "
            "ones before stay in use).",
            ("outcome",),
            registry=registry,
        )
        self._outcomes = {o: self.counter.labels(o) for o in ("loaded", "failed")}

    def inc(self, outcome: str) -> None:
        self._outcomes[outcome].inc()


class UpstreamProtocolErrors:
    """`tokenprobe_upstream_protocol_errors_total{kind}`: a misbehaving backend, seen on
    either data path. Each count closed one upstream connection (never reused); a request
    on it, if one was in flight, ended with the proxy's 502."""

    def __init__(self, registry: CollectorRegistry) -> None:
        kinds = "; ".join(f"{kind}: {what}" for kind, what in UPSTREAM_PROTOCOL_ERRORS.items())
        self.counter = Counter(
            "tokenprobe_upstream_protocol_errors",
            "Upstream connections closed for breaking HTTP/1.1, counted at the instant the "
            f"proxy saw the offending bytes, by kind ({kinds}).",
            ("kind",),
            registry=registry,
        )
        self._kinds = {kind: self.counter.labels(kind) for kind in UPSTREAM_PROTOCOL_ERRORS}

    def inc(self, kind: str) -> None:
        self._kinds[kind].inc()


class WsMetrics:
    """WebSocket tunnels: counted by route (a WsApi's endpoint, else "other") and outcome.

    Part of `Metrics` (its `ws`): `Sinks.session_started` moves the in-flight gauge, and
    `Metrics.session` counts each session's record when its tunnel ends; a route's
    children are resolved once (`for_route`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.sessions = Counter(
            "tokenprobe_websocket_sessions",
            "WebSocket upgrade requests the proxy tunnelled (or tried to), counted when the "
            "tunnel ended: from the upgrade request's arrival to the close of both sides, by "
            "route and outcome (who sent the first close frame, who vanished without one, "
            "idle_timeout (no byte either way for --ws-idle-timeout, from the upstream's 101), "
            "shutdown, refused (another final status: its body read under --idle-timeout, as "
            "an HTTP response's), upstream_unreachable, "
            "upstream_timeout (no final answer to the handshake within --first-byte-timeout: "
            "the client got the proxy's 504), upstream_error (an answer HTTP/1.1 refuses: the "
            "client got the proxy's 502), invalid_request_target, too_many_websockets "
            "(--ws-max-tunnels were open: the client got the proxy's 503), error; "
            "with --workers, worker_died: counted at the first scrape after its worker died).",
            ("route", "outcome"),
            registry=registry,
        )
        self.in_flight = Gauge(
            "tokenprobe_websocket_sessions_in_flight",
            "WebSocket tunnels from the handshake going upstream (its turn on the "
            "connection: one pipelined behind a response is counted once that ends, "
            "though its duration runs from its arrival) to the close.",
            ("route",),
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.duration = Histogram(
            "tokenprobe_websocket_session_duration_seconds",
            "WebSocket session duration: from the upgrade request's arrival to the close "
            "(the first side's connection ending, the idle timeout or the drain closing it).",
            ("route",),
            registry=registry,
            buckets=WS_SESSION_BUCKETS,
        )
        self._routes: dict[str, tuple[Any, Any, dict[str, Any]]] = {}

    def for_route(self, route: str) -> tuple[Any, Any, dict[str, Any]]:
        """(in-flight child, duration child, outcome -> counter child) for one route."""
        children = self._routes.get(route)
        if children is None:
            counts = {o: self.sessions.labels(route, o) for o in WS_OUTCOMES}
            children = (self.in_flight.labels(route), self.duration.labels(route), counts)
            self._routes[route] = children
        return children


class _LazyChildren:
    """The label children of one key for metrics that only some requests have, each made
    the first time a request has its figure (then an attribute like `_bound`'s)."""

    def __init__(self, metrics: dict[str, Any], key: tuple[str, ...]) -> None:
        self._metrics, self._key = metrics, key

    def __getattr__(self, name: str) -> Any:
        child = self._metrics[name].labels(*self._key)
        setattr(self, name, child)
        return child


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
    # The child's bounds end in +Inf, so the slot above it only counts a NaN, which
    # `observe` puts in no bucket either: zip leaves it out.
    for bucket, count in zip(buckets, bucket_counts(bounds, values), strict=False):
        if count:
            bucket.inc(count)
    if values:
        total.inc(sum(values))


def _factory(kind: Any, registry: CollectorRegistry, attribution: tuple[str, ...] = ()) -> Any:
    def make(name: str, doc: str, labels: tuple[str, ...] = (), **kw: Any) -> Any:
        return kind(name, doc, (*LABELS, *attribution, *labels), registry=registry, **kw)

    return make
