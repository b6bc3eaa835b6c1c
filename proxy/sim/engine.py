"""The engine's own account of a request, as vLLM 0.32 gives it with
`--enable-per-request-metrics`: the `metrics` object (vllm/entrypoints/generate/base/
protocol.py, PerRequestMetrics and SpeculativeDecodingMetrics), in vLLM's field order.

The simulator's figures are what it did, measured on its own clock: the queue time is
the wait for a slot under `max_num_seqs` (routed to generation -> scheduled; a stall
before that, `x-sim-stall-before-headers`, is the front end's, outside the engine), the engine's
time to first token runs from scheduling to the write of the first content chunk, the
generation time from the first to the last content chunk. Speculative decoding is
programmed: `spec_tokens` drafts per verify step, of which `round(acceptance_rate *
spec_tokens)` are accepted, so each content chunk carries that many + 1 tokens (one step
per chunk) and the counts follow from the tokens sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson


@dataclass(frozen=True, slots=True)
class Spec:
    """Programmed speculative decoding: `tokens` drafts a step, `accepted` of them kept."""

    tokens: int
    accepted: int

    @property
    def per_chunk(self) -> int:
        return self.accepted + 1  # the accepted drafts and the target's bonus token


def spec_from(spec_tokens: int, acceptance_rate: float) -> Spec | None:
    if spec_tokens <= 0:
        return None
    return Spec(spec_tokens, min(spec_tokens, max(0, round(acceptance_rate * spec_tokens))))


def metrics_json(
    *,
    queue: float,
    first_token: float,
    generation: float,
    output_tokens: int,
    chunks: int,
    spec: Spec | None,
    null_spec: bool,
) -> bytes:
    """The `metrics` object. `null_spec`: write the nulls, `"speculative_decoding":null`
    when there is none and the per-step lists' when there is (vLLM's non-streamed bodies
    are a whole `model_dump()`; its usage chunk is dumped with `exclude_none`)."""
    obj: dict[str, object] = {
        "time_to_first_token_ms": first_token * 1000.0,
        "generation_time_ms": generation * 1000.0,
        "queue_time_ms": queue * 1000.0,
        "mean_itl_ms": generation * 1000.0 / (output_tokens - 1) if output_tokens > 1 else 0.0,
        "tokens_per_second": (output_tokens / (first_token + generation))
        if first_token + generation > 0
        else 0.0,
    }
    if spec is not None and chunks > 0:
        accepted = output_tokens - chunks  # every step's bonus token is not a draft
        drafted = spec.tokens * chunks
        histogram = [0] * (spec.tokens + 1)
        full, last = divmod(output_tokens, spec.per_chunk)
        histogram[spec.accepted] += full
        if last:
            histogram[last - 1] += 1
        spec_obj: dict[str, object] = {
            "mean_acceptance_length": output_tokens / chunks,
            "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
            "acceptance_histogram": histogram,
            "num_spec_steps": chunks,
            "num_accepted_draft_tokens": accepted,
            "num_draft_tokens": drafted,
            "num_spec_tokens": spec.tokens,
        }
        # the per-step lists: filled only when vLLM records them (v1/metrics/stats.py)
        if null_spec:
            spec_obj |= {"per_step_accepted": None, "per_step_drafted": None}
        obj["speculative_decoding"] = spec_obj
    elif null_spec:
        obj["speculative_decoding"] = None
    return orjson.dumps(obj)
