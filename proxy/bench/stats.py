"""Per-level summaries. Three figures that are easy to confuse are kept apart by name:

  ttft                    time to first token, per request (s)
  decode_tokens_per_second  one stream's generation speed after its first token (tok/s)
  output_throughput       all streams together: output tokens / wall time of the level (tok/s)

Latency and speed figures are over successful requests; failed ones are counted by type.
Quantiles interpolate linearly between the two nearest ranks (numpy's default).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from proxy.bench.client import Result
from proxy.bench.load import Level
from proxy.core import slo
from proxy.core.measurement import Measurement

QUANTILES = (50, 90, 95, 99)


def quantile(ordered: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) of an already sorted sequence."""
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: Iterable[float | None]) -> dict[str, float | None]:
    """{"mean", "p50", "p90", "p95", "p99", "max"} of the non-None values (None when there are none)."""
    ordered = sorted(v for v in values if v is not None)
    out: dict[str, float | None] = {"mean": sum(ordered) / len(ordered) if ordered else None}
    for q in QUANTILES:
        out[f"p{q}"] = quantile(ordered, q)
    out["max"] = ordered[-1] if ordered else None
    return out


@dataclass(frozen=True, slots=True)
class Summary:
    label: str
    value: float  # the concurrency or the rate
    requests: int  # finished and recorded
    ok: int
    errors: dict[str, int]  # error type -> count
    error_examples: dict[str, str]  # error type -> the first such request's message
    truncated: int  # finish_reason "length" (every request, with ignore_eos)
    cancelled: int  # in flight when the run was stopped; not in any other figure
    duration: float  # wall time of the level (s)
    ttft: dict[str, float | None]
    tpot: dict[str, float | None]
    itl: dict[str, float | None]
    e2e: dict[str, float | None]
    decode_tokens_per_second: dict[str, float | None]  # per request, single stream
    send_delay: dict[str, float | None]  # how late requests were sent after they were due
    loop_lag: dict[str, float | None]  # how late the bench's own event loop woke up
    prompt_tokens: int
    output_tokens: int
    token_sources: dict[str, int]
    output_throughput: float  # all streams: output tokens / duration
    request_throughput: float  # successful requests / duration
    goodput: float | None  # requests meeting every SLO / duration (None without --slo)
    slo_met: int | None
    #: Where the first token's time went, over the streams whose engine sent vLLM's
    #: per-request metrics: {"requests", "queue", "engine", "outside"} (mean seconds,
    #: adding up to those requests' mean TTFT); None when none did.
    ttft_split: dict[str, float] | None = None
    #: Speculative decoding as the engine counted it: {"draft", "accepted",
    #: "acceptance_rate", "mean_acceptance_length"}; None without it.
    spec_decode: dict[str, float] | None = None
    #: Output tokens per content event, mean over streams (usage or tokenizer counts).
    tokens_per_chunk: float | None = None
    #: Issue 26: time to the first answer token (not reasoning nor tool calls), the
    #: reasoning tokens of all successful requests, tool calls by outcome, and the
    #: streams that generated but delivered no answer and no call.
    ttfa: dict[str, float | None] | None = None
    reasoning_tokens: int = 0
    reasoned: int = 0  # requests that reasoned
    tool_calls: dict[str, int] | None = None
    without_answer: int = 0


def summarize(level: Level, slo: dict[str, float]) -> Summary:
    results = level.results
    good = [r.m for r in results if r.m.ok]
    duration = max(level.end - level.start, 1e-9)
    output = sum(m.output_tokens or 0 for m in good)
    met = sum(1 for r in results if meets(r, slo)) if slo else None
    return Summary(
        label=level.label,
        value=level.value,
        requests=len(results),
        ok=len(good),
        errors=dict(Counter(r.m.error_type.value for r in results if r.m.error_type is not None)),
        error_examples=_examples(results),
        truncated=sum(1 for r in results if r.m.finish_reason == "length"),
        cancelled=level.cancelled,
        duration=duration,
        ttft=distribution(m.ttft for m in good),
        tpot=distribution(m.tpot for m in good),
        itl=distribution(gap for m in good for gap in m.inter_token_latencies),
        e2e=distribution(m.e2e for m in good),
        decode_tokens_per_second=distribution(m.decode_tokens_per_second for m in good),
        send_delay=distribution(r.sent - r.scheduled for r in results),
        loop_lag=distribution(level.loop_lag),
        prompt_tokens=sum(m.prompt_tokens or 0 for m in good),
        output_tokens=output,
        token_sources=dict(Counter(m.token_source.value for m in good)),
        output_throughput=output / duration,
        request_throughput=len(good) / duration,
        goodput=None if met is None else met / duration,
        slo_met=met,
        ttft_split=ttft_split(good),
        spec_decode=spec_decode(good),
        tokens_per_chunk=_mean([r for m in good if (r := m.output_tokens_per_chunk()) is not None]),
        ttfa=distribution(m.first_answer for m in good),
        reasoning_tokens=sum(m.reasoning_tokens or 0 for m in good),
        reasoned=sum(1 for m in good if m.first_reasoning is not None),
        tool_calls=dict(Counter(c.outcome for m in good for c in m.tool_calls)) or None,
        without_answer=sum(1 for r in results if r.m.without_answer is not None),
    )


def ttft_split(records: Sequence[Measurement]) -> dict[str, float] | None:
    splits = [s for m in records if (s := m.ttft_split()) is not None]
    if not splits:
        return None
    n = len(splits)
    queues = [s[0] for s in splits if s[0] is not None]
    return {
        "requests": n,
        # The mean over the streams whose engine reports a queue time (llama.cpp does not:
        # its queue wait is then outside), absent when none does.
        **({"queue": sum(queues) / len(queues)} if queues else {}),
        "engine": sum(s[1] for s in splits) / n,
        "outside": sum(s[2] for s in splits) / n,
    }


def spec_decode(records: Sequence[Measurement]) -> dict[str, float] | None:
    specs = [m.engine.spec for m in records if m.engine is not None and m.engine.spec is not None]
    if not specs:
        return None
    draft, accepted = sum(s.draft_tokens for s in specs), sum(s.accepted_tokens for s in specs)
    lengths = [s.mean_acceptance_length for s in specs if s.mean_acceptance_length is not None]
    return {
        "requests": len(specs),
        "draft": draft,
        "accepted": accepted,
        "acceptance_rate": accepted / draft if draft else 0.0,
        "mean_acceptance_length": sum(lengths) / len(lengths) if lengths else 0.0,
    }


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def meets(result: Result, limits: dict[str, float]) -> bool:
    """The request met every target, as proxy/core/slo.py defines it for the proxy too."""
    return slo.verdict(result.m, limits) == slo.MET


def _examples(results: Iterable[Result], limit: int = 160) -> dict[str, str]:
    examples: dict[str, str] = {}
    for r in results:
        kind = r.m.error_type
        if kind is not None and kind.value not in examples and r.m.error_message:
            examples[kind.value] = " ".join(r.m.error_message.split())[:limit]
    return examples
