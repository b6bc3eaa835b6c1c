"""Is run B different from run A, or is it noise? A seeded bootstrap over per-request records.

Each figure of a level (TTFT p50, aggregate output tok/s, error share, ...) is computed
from that level's per-request records. To know how much of a difference between two runs
is noise, both runs' records are resampled with replacement `rounds` times (independently,
with a seeded generator, so the same files always give the same answer) and the figure's
change is taken each time; the interval holds the central `confidence` share of those
changes (the percentile bootstrap).

Changes are relative (B / A - 1) for latencies and speeds, and in percentage points
(B - A) for shares (errors, truncations), whose baseline is often 0.

What the interval covers: request-to-request variation within each run. It does not see
run-to-run drift of the machine (another job, a warmer cache): that is why a change must
also be at least `min_change` before it is called a difference, and why a suspicious
result is worth a rerun.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.bench.stats import quantile
from proxy.core.engine import EngineMetrics, ttft_split
from proxy.core.slo import MET, record_verdict


@dataclass(frozen=True, slots=True)
class Figure:
    name: str  # what --metric takes
    title: str  # the table's row name
    lower_is_better: bool
    share: bool  # a fraction of requests: changes in percentage points
    scale: float = 1.0  # for display: 1000 shows seconds as ms, 100 a fraction as %
    unit: str = ""


FIGURES: tuple[Figure, ...] = (
    Figure("ttft_p50", "TTFT p50", True, False, 1000, "ms"),
    Figure("ttft_p95", "TTFT p95", True, False, 1000, "ms"),
    Figure("tpot_p50", "TPOT p50", True, False, 1000, "ms"),
    Figure("tpot_p95", "TPOT p95", True, False, 1000, "ms"),
    Figure("decode_tps_p50", "per-stream decode p50", False, False, 1, "tok/s"),
    Figure("output_tps", "aggregate output", False, False, 1, "tok/s"),
    Figure("goodput", "goodput", False, False, 1, "req/s"),
    # The share of requests that met every --slo target (proxy/core/slo.py): the figure
    # `tokenprobe serve --slo` exports live as tokenprobe_slo_requests_total.
    Figure("attainment", "SLO attainment", False, True, 100, "%"),
    # Where the first token's time went (vLLM --enable-per-request-metrics; rows only
    # when some run's requests carried the engine's object): means, so they add up.
    Figure("queue_mean", "TTFT: engine queue, mean", True, False, 1000, "ms"),
    Figure("engine_ttft_mean", "TTFT: engine prefill, mean", True, False, 1000, "ms"),
    Figure("outside_mean", "TTFT: outside the engine, mean", True, False, 1000, "ms"),
    Figure("error_share", "errors", True, True, 100, "%"),
    Figure("length_share", "finish=length", True, True, 100, "%"),
    # Reasoning models and agents (issue 26; rows only when some run's requests had them)
    Figure("ttfa_p50", "first answer p50", True, False, 1000, "ms"),
    Figure("ttfa_p95", "first answer p95", True, False, 1000, "ms"),
    Figure("reasoning_tokens_mean", "reasoning tokens, mean", True, False, 1, "tok"),
    Figure("without_answer_share", "no answer", True, True, 100, "%"),
    Figure("bad_tool_call_share", "a call not complete", True, True, 100, "%"),
)
BY_NAME: Mapping[str, Figure] = {f.name: f for f in FIGURES}

# One request as the bootstrap sees it: ok, ttft, tpot, decode tok/s, output tokens,
# finished by length, met every SLO, e2e, and the TTFT split (queue, engine, outside)
# when the engine sent its per-request metrics.
Split = tuple[float | None, float, float] | None
# ... then (issue 26) first answer, reasoning tokens (None: did not reason), no answer,
# tool calls made (None: none), a call not complete
Row = tuple[
    bool, float | None, float | None, float | None, int, bool, bool, float, Split,
    float | None, int | None, bool, int | None, bool,
]  # fmt: skip

#: Any figure gets an interval only from this many requests in each run. The bootstrap
#: resamples only what it saw, so from a few requests its interval is too narrow (1 vs 1
#: has no width at all). Measured with null trials, both runs drawn from one lognormal
#: TTFT and TPOT (1000 trials of 400 resamples each): the share whose 95% interval left
#: out 0, nominally 5%, was 31-34% of the p50s at 2 requests a run, 9-10% at 3, 7-8% at
#: 4, then 3.7-3.8% at 5 and 3-5% at 6, 8, 10, 15, 20, 30 and 40: 5 is the smallest n
#: near the nominal level. A latency counts the requests that succeeded, as only those
#: gave it; a figure over every request (errors, throughput, goodput) counts them all.
MIN_REQUESTS = 5
#: The figures taken over every request of a level, failed ones included.
OVER_ALL = frozenset({"output_tps", "goodput", "attainment", "error_share"})
#: A tail quantile gets an interval only with this many requests beyond it (p95: 100
#: requests); with fewer, the bootstrap has too few tail values to resample.
TAIL_REQUESTS = 5
TAILS = {"ttft_p95": 0.95, "tpot_p95": 0.95, "ttfa_p95": 0.95}


def rows(records: Sequence[Mapping[str, Any]], slo: Mapping[str, float]) -> list[Row]:
    out: list[Row] = []
    for r in records:
        ok = r.get("error_type") is None
        met = record_verdict(r, slo) == MET
        out.append(
            (
                ok,
                r.get("ttft") if ok else None,
                r.get("tpot") if ok else None,
                r.get("decode_tokens_per_second") if ok else None,
                int(r.get("output_tokens") or 0) if ok else 0,
                ok and r.get("finish_reason") == "length",
                met,
                float(r.get("e2e") or 0.0),
                _split(r) if ok else None,
                *_kinds(r, ok),
            )
        )
    return out


def _kinds(
    record: Mapping[str, Any], ok: bool
) -> tuple[float | None, int | None, bool, int | None, bool]:
    """A saved record's first answer, reasoning tokens, no answer, calls and a bad call."""
    calls = record.get("tool_calls") or ()
    outcomes = [c.get("outcome") for c in calls if isinstance(c, Mapping)]
    reasoning = record.get("reasoning_tokens")
    return (
        record.get("first_answer") if ok else None,
        reasoning
        if ok and type(reasoning) is int and record.get("first_reasoning") is not None
        else None,
        record.get("without_answer") is not None,
        len(outcomes) if outcomes else None,
        any(o != "complete" for o in outcomes),
    )


def _split(record: Mapping[str, Any]) -> Split:
    """The saved record's TTFT split (proxy/core/engine.py), None without the engine's times."""
    engine, ttft = record.get("engine"), record.get("ttft")
    if not isinstance(engine, Mapping) or not isinstance(ttft, int | float):
        return None
    queue, first = engine.get("queue_time"), engine.get("time_to_first_token")
    if not isinstance(first, int | float):
        return None
    queue_time = float(queue) if isinstance(queue, int | float) else None  # llama.cpp: none
    return ttft_split(float(ttft), EngineMetrics(queue_time, float(first), None, None, None, None))


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def pace(sample: Sequence[Row]) -> float | None:
    """Output tokens per second of request time: how a resample's throughput moves. The
    time of every request, failed ones too: a failure held its slot and gave no tokens,
    so a resample with more of them is slower (over successes alone their share moved
    nothing, and the interval had no width however uncertain the share was)."""
    busy = sum(row[7] for row in sample)
    return sum(row[4] for row in sample if row[0]) / busy if busy > 0 else None


def figures(
    sample: Sequence[Row], duration: float, has_slo: bool, scale: float | None = None
) -> dict[str, float | None]:
    """Every figure of FIGURES from one level's requests (or a resample of them).

    Aggregate throughput is output tokens / the level's wall time. A resample keeps the
    wall time, which would hide that requests took longer or shorter; so a resample's
    throughput is the observed one times how its pace (`pace`) differs from the observed
    pace: `scale` = observed throughput / observed pace.
    """
    ok = [row for row in sample if row[0]]
    ttft = sorted(row[1] for row in ok if row[1] is not None)
    tpot = sorted(row[2] for row in ok if row[2] is not None)
    speed = sorted(row[3] for row in ok if row[3] is not None)
    n = len(sample)
    splits = [row[8] for row in ok if row[8] is not None]
    ttfa = sorted(row[9] for row in ok if row[9] is not None)
    reasoning = [float(row[10]) for row in ok if row[10] is not None]
    calling = [row for row in sample if row[12] is not None]
    return {
        "ttft_p50": quantile(ttft, 50),
        "ttft_p95": quantile(ttft, 95),
        "tpot_p50": quantile(tpot, 50),
        "tpot_p95": quantile(tpot, 95),
        "decode_tps_p50": quantile(speed, 50),
        "output_tps": _throughput(sample, duration, scale) if ok else None,
        "goodput": sum(1 for row in sample if row[6]) / duration if has_slo else None,
        "attainment": sum(1 for row in sample if row[6]) / n if has_slo and n else None,
        "queue_mean": _mean([s[0] for s in splits if s[0] is not None]),
        "engine_ttft_mean": _mean([s[1] for s in splits]),
        "outside_mean": _mean([s[2] for s in splits]),
        "error_share": (n - len(ok)) / n if n else None,
        "length_share": sum(1 for row in ok if row[5]) / len(ok) if ok else None,
        "ttfa_p50": quantile(ttfa, 50),
        "ttfa_p95": quantile(ttfa, 95),
        "reasoning_tokens_mean": _mean(reasoning),
        "without_answer_share": (
            sum(1 for row in sample if row[11]) / n
            if n and any(r[11] or r[10] is not None for r in sample)
            else None
        ),
        "bad_tool_call_share": (
            sum(1 for row in calling if row[13]) / len(calling) if calling else None
        ),
    }


def _throughput(sample: Sequence[Row], duration: float, scale: float | None) -> float | None:
    if scale is None:
        return sum(row[4] for row in sample if row[0]) / duration
    p = pace(sample)
    return None if p is None else p * scale


def _scale(sample: Sequence[Row], duration: float) -> float | None:
    observed, p = _throughput(sample, duration, None), pace(sample)
    return observed / p if observed is not None and p else None


@dataclass(frozen=True, slots=True)
class Change:
    """One figure of run B against run A. `change`, `low`, `high`: relative (0.1 = +10%)
    or, for shares, in fractions of requests (0.01 = +1 percentage point)."""

    figure: str
    base: float | None
    value: float | None
    change: float | None
    low: float | None
    high: float | None
    verdict: str  # "better", "worse", "same" (noise or below min_change), "n/a"
    reason: str | None = None  # why there is no interval, where the data was too thin

    def worse_beyond(self, limit: float) -> bool:
        """Worse by more than `limit` (same units as `change`) with the interval's confidence."""
        if self.low is None or self.high is None:
            return False
        if BY_NAME[self.figure].lower_is_better:
            return self.low > limit
        return self.high < -limit


def _delta(figure: Figure, base: float | None, value: float | None) -> float | None:
    if base is None or value is None:
        return None
    if figure.share:
        return value - base
    return value / base - 1 if base else None


def compare(
    base: Sequence[Row],
    base_duration: float,
    other: Sequence[Row],
    other_duration: float,
    *,
    has_slo: bool,
    rounds: int = 2000,
    confidence: float = 0.95,
    min_change: float = 0.05,
    seed: int = 0,
) -> dict[str, Change]:
    """Every figure of `other` against `base`, with its bootstrap interval and verdict."""
    a = figures(base, base_duration, has_slo)
    b = figures(other, other_duration, has_slo)
    rng = random.Random(seed)
    deltas: dict[str, list[float]] = {f.name: [] for f in FIGURES}
    base_scale, other_scale = _scale(base, base_duration), _scale(other, other_duration)
    if base and other:
        for _ in range(rounds):
            ra = figures(rng.choices(base, k=len(base)), base_duration, has_slo, base_scale)
            rb = figures(rng.choices(other, k=len(other)), other_duration, has_slo, other_scale)
            for f in FIGURES:
                d = _delta(f, ra[f.name], rb[f.name])
                if d is not None:
                    deltas[f.name].append(d)
    tail = (1 - confidence) / 2 * 100
    out = {}
    for f in FIGURES:
        change = _delta(f, a[f.name], b[f.name])
        spread = sorted(deltas[f.name])
        reason = _too_thin(f, _count(f, base), _count(f, other), len(spread), rounds)
        if change is None or reason is not None:
            out[f.name] = Change(f.name, a[f.name], b[f.name], change, None, None, "n/a", reason)
            continue
        low, high = quantile(spread, tail), quantile(spread, 100 - tail)
        assert low is not None and high is not None
        out[f.name] = Change(
            f.name,
            a[f.name],
            b[f.name],
            change,
            low,
            high,
            _verdict(f, change, low, high, min_change),
        )
    return out


def _count(figure: Figure, sample: Sequence[Row]) -> int:
    """How many of a run's requests the figure is taken over (see MIN_REQUESTS)."""
    return len(sample) if figure.name in OVER_ALL else sum(1 for row in sample if row[0])


def _too_thin(figure: Figure, base: int, other: int, figures: int, rounds: int) -> str | None:
    """Why runs of `base` and `other` requests hold too little for an interval, or None."""
    fewest = min(base, other)
    if fewest < MIN_REQUESTS:
        return f"from {fewest} requests, an interval needs {MIN_REQUESTS}"
    tail_q = TAILS.get(figure.name)
    if tail_q is not None and fewest * (1 - tail_q) < TAIL_REQUESTS:
        need = TAIL_REQUESTS / (1 - tail_q)
        return f"from {fewest} requests, a p{tail_q * 100:g} interval needs {need:.0f}"
    if figures < rounds / 2:  # most resamples held no value of it (rare successes)
        return "too few requests gave a value"
    return None


def _verdict(figure: Figure, change: float, low: float, high: float, min_change: float) -> str:
    if not (low > 0 or high < 0) or abs(change) < min_change:
        return "same"
    return "worse" if (change > 0) == figure.lower_is_better else "better"
