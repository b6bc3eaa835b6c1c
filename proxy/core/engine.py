"""The engine's own account of one request: vLLM's per-request `metrics` object, typed.

One adapter per engine turns its object into `EngineMetrics`: this module's
`engine_metrics` for vLLM, proxy/core/llamacpp.py for llama.cpp's `timings`.

vLLM 0.32 started with `--enable-per-request-metrics` adds `metrics` to a non-streamed
answer, to the final usage chunk of a stream (so only when usage is streamed, which the
proxy asks for) and to the response of the Responses API's `response.completed`. Its
schema is `PerRequestMetrics` in vllm/entrypoints/generate/base/protocol.py
(vllm-project/vllm): `time_to_first_token_ms`, `generation_time_ms`, `queue_time_ms`,
`mean_itl_ms`, `tokens_per_second`, all optional floats, and `speculative_decoding`, a
`SpeculativeDecodingMetrics` (with `--per-request-spec-decode-metrics summary|detailed`):
`mean_acceptance_length`, `draft_acceptance_rate`, `acceptance_histogram`,
`num_spec_steps`, `num_accepted_draft_tokens`, `num_draft_tokens`, `num_spec_tokens`. It is
`null` for n > 1. The engine's times are read as the issue reports them: the queue time is
the wait before scheduling, the engine's time to first token runs from scheduling to the
first token, so client-seen TTFT = queue + engine TTFT + the time outside the engine.

Read once per request, from the one event (or body) that carries it; never per chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SpecDecode:
    """Speculative decoding for one request, as the engine counted it."""

    draft_tokens: int  # num_draft_tokens: tokens proposed by the drafter
    accepted_tokens: int  # num_accepted_draft_tokens: of those, accepted by the target
    mean_acceptance_length: float | None  # tokens per verify step, bonus token included
    acceptance_rate: float | None  # draft_acceptance_rate = accepted / draft
    steps: int | None  # num_spec_steps: verify steps


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """The engine's figures in seconds (vLLM sends milliseconds); None when absent."""

    queue_time: float | None
    time_to_first_token: float | None
    generation_time: float | None
    mean_itl: float | None
    tokens_per_second: float | None
    spec: SpecDecode | None
    #: Loading the model before the request could run (Ollama's load_duration); None from
    #: an engine that does not report it (vLLM serves a loaded model).
    load_time: float | None = None
    # Token counts in the engine's own account (llama.cpp's timings: proxy/core/llamacpp.py):
    # the prompt tokens it took from its cache, those it processed, and those it generated.
    cached_tokens: int | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    # The fields that were there but made no sense (wrong type, negative, huge): each None
    # above, named here (from the adapter's closed set) so that a metric can count them.
    invalid: tuple[str, ...] = ()


#: An engine adapter: the engine's own per-request object, as the seam found it
#: (Facts.engine), to its figures in seconds; None when the object says nothing. One per
#: engine, each in its own module (vLLM's is `engine_metrics` below, Ollama's in
#: proxy/core/engine_ollama.py); a seam names its adapter in `Api.engine_figures`.
EngineAdapter = Callable[[object], "EngineMetrics | None"]


def engine_metrics(obj: object) -> EngineMetrics | None:
    """The typed figures of a `metrics` object, or None when it is not one (null, n > 1,
    another backend's field of that name). A field of the wrong type or below 0 is None."""
    if type(obj) is not dict:
        return None
    found = EngineMetrics(
        queue_time=_seconds(obj.get("queue_time_ms")),
        time_to_first_token=_seconds(obj.get("time_to_first_token_ms")),
        generation_time=_seconds(obj.get("generation_time_ms")),
        mean_itl=_seconds(obj.get("mean_itl_ms")),
        tokens_per_second=_number(obj.get("tokens_per_second")),
        spec=_spec(obj.get("speculative_decoding")),
    )
    return None if found == _EMPTY else found


_EMPTY = EngineMetrics(None, None, None, None, None, None)


def ttft_split(ttft: float, engine: EngineMetrics) -> tuple[float | None, float, float] | None:
    """(queue, engine TTFT, outside the engine) for a client-seen `ttft`, summing to it
    exactly, or None when the engine gave no TTFT. The queue part is None when the engine
    reports no queue time (llama.cpp: proxy/core/llamacpp.py); a wait in its queue is then
    part of what is outside.

    outside = ttft - queue - engine TTFT, never below 0: when the engine's parts add up to
    more than the client saw (clocks, rounding), they are scaled down by the same factor so
    that they add up to `ttft` and outside is 0. Either way the parts of every request sum
    to its TTFT, so their histogram sums add up to the TTFT sum."""
    queue, first = engine.queue_time, engine.time_to_first_token
    if first is None or (queue is None and engine.load_time is not None):
        return None  # no TTFT, or a model-load part instead of a queue (load_split: Ollama)
    inside = first if queue is None else queue + first
    if inside <= ttft:
        return queue, first, ttft - inside
    if inside <= 0.0:
        return (None if queue is None else 0.0), 0.0, ttft
    if queue is None:
        return None, ttft, 0.0
    queue *= ttft / inside
    return queue, ttft - queue, 0.0


def load_split(ttft: float, engine: EngineMetrics) -> tuple[float, float, float] | None:
    """(model load, engine TTFT, outside the engine) for a client-seen `ttft`, summing to it
    exactly, for an engine that reports a load time and no queue time (Ollama), or None.
    The same rule as `ttft_split`: outside = ttft - load - engine TTFT, never below 0, the
    engine's two parts scaled down together when they exceed what the client saw."""
    load, first = engine.load_time, engine.time_to_first_token
    if load is None or first is None or engine.queue_time is not None:
        return None
    inside = load + first
    if inside <= ttft:
        return load, first, ttft - inside
    if inside <= 0.0:
        return 0.0, 0.0, ttft
    load *= ttft / inside
    return load, ttft - load, 0.0


def _number(value: object) -> float | None:
    if type(value) is float or type(value) is int:
        return float(value) if value >= 0 else None
    return None


def _seconds(value: object) -> float | None:
    number = _number(value)
    return None if number is None else number / 1000.0


def _count(value: object) -> int | None:
    return value if type(value) is int and value >= 0 else None


def _spec(obj: object) -> SpecDecode | None:
    if type(obj) is not dict:
        return None
    draft, accepted = (
        _count(obj.get("num_draft_tokens")),
        _count(obj.get("num_accepted_draft_tokens")),
    )
    if draft is None or accepted is None:
        return None
    return SpecDecode(
        draft_tokens=draft,
        accepted_tokens=accepted,
        mean_acceptance_length=_number(obj.get("mean_acceptance_length")),
        acceptance_rate=_number(obj.get("draft_acceptance_rate")),
        steps=_count(obj.get("num_spec_steps")),
    )
