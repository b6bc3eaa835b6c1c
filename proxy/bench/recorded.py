"""The replay's report: the log's own figures beside the replayed ones.

Recorded figures come from the access-log lines (ttft_ms, tpot_ms, e2e_ms over the
requests that succeeded; error and `length` shares over all), replayed ones from the
run's records, by the same quantile code (stats.distribution).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from proxy.bench.stats import distribution
from proxy.bench.trace import Want


def recorded_figures(wants: Sequence[Want]) -> dict[str, Any]:
    """The log's own TTFT, TPOT and e2e quantiles (s) and error and `length` shares."""
    rec = [w.recorded for w in wants if w.recorded]
    ok = [r for r in rec if r.get("error_type") is None]

    def seconds(key: str) -> dict[str, float | None]:
        return distribution(r[key] / 1000 if r.get(key) is not None else None for r in ok)

    return {
        "requests": len(rec),
        "ttft": seconds("ttft_ms"),
        "tpot": seconds("tpot_ms"),
        "e2e": seconds("e2e_ms"),
        "error_share": (len(rec) - len(ok)) / len(rec) if rec else None,
        "length_share": sum(r.get("finish_reason") == "length" for r in rec) / len(rec)
        if rec
        else None,
    }


def replayed_figures(levels: Sequence[Any]) -> dict[str, Any]:
    results = [r for level in levels for r in level.results]
    ok = [r.m for r in results if r.m.ok]
    n = len(results)
    return {
        "requests": n,
        "ttft": distribution(m.ttft for m in ok),
        "tpot": distribution(m.tpot for m in ok),
        "e2e": distribution(m.e2e for m in ok),
        "error_share": (n - len(ok)) / n if n else None,
        "length_share": sum(r.m.finish_reason == "length" for r in results) / n if n else None,
    }


def side_by_side(wants: Sequence[Want], levels: Sequence[Any]) -> str:
    rec, rep = recorded_figures(wants), replayed_figures(levels)
    if not rec["requests"]:
        return "(the workload holds no recorded latencies: a Mooncake trace)"
    lines = [f"{'':<14}{'recorded':>10}{'replayed':>10}{'change':>9}"]
    for name, unit in (("ttft", "ms"), ("tpot", "ms"), ("e2e", "ms")):
        for q in ("p50", "p95", "p99"):
            a, b = rec[name][q], rep[name][q]
            lines.append(_row(f"{name.upper()} {unit} {q}", a, b, 1000))
    for name in ("error_share", "length_share"):
        lines.append(_row(name.replace("_", " ") + " %", rec[name], rep[name], 100))
    return "\n".join(lines)


def _row(name: str, a: float | None, b: float | None, scale: float) -> str:
    def show(v: float | None) -> str:
        return "-" if v is None else f"{v * scale:.1f}"

    change = f"{(b - a) / a * 100:+.0f}%" if a and b is not None else ""
    return f"{name:<14}{show(a):>10}{show(b):>10}{change:>9}"
