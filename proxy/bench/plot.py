"""`--plot`: what each load level bought and what it cost.

Left and middle: aggregate output tokens/s (x) against TTFT p95 and TPOT p95 (y), one
point per level, labelled with it. Right: the TTFT distribution (empirical CDF) per level.
matplotlib is imported only here, with the Agg backend (no display needed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from proxy.bench.load import Level
from proxy.bench.stats import Summary


def draw(path: str, levels: Sequence[Level], summaries: Sequence[Summary]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ttft_ax, tpot_ax, cdf_ax) = plt.subplots(1, 3, figsize=(16, 4.8))
    x = [s.output_throughput for s in summaries]
    for ax, key, title in ((ttft_ax, "ttft", "TTFT p95"), (tpot_ax, "tpot", "TPOT p95")):
        y = [_ms(getattr(s, key)["p95"]) for s in summaries]
        ax.plot(x, y, marker="o")
        for s, xi, yi in zip(summaries, x, y, strict=True):
            if not math.isnan(yi):
                ax.annotate(
                    s.label, (xi, yi), textcoords="offset points", xytext=(5, 5), fontsize=8
                )
        ax.set_xlabel("aggregate output throughput (tokens/s, all streams)")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title} vs aggregate throughput")
        finite = [v for v in y if not math.isnan(v)]
        ax.set_ylim(0, max(finite) * 1.2 if finite and max(finite) > 0 else 1)  # room for labels
        ax.grid(True, alpha=0.3)
    for level in levels:
        ttfts = sorted(r.m.ttft * 1000 for r in level.results if r.m.ok and r.m.ttft is not None)
        if ttfts:
            cdf_ax.step(
                ttfts,
                [(i + 1) / len(ttfts) for i in range(len(ttfts))],
                where="post",
                label=level.label,
            )
    cdf_ax.set_xlabel("TTFT (ms)")
    cdf_ax.set_ylabel("fraction of requests")
    cdf_ax.set_title("TTFT distribution")
    cdf_ax.grid(True, alpha=0.3)
    if any(level.results for level in levels):
        cdf_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ms(value: float | None) -> float:
    return math.nan if value is None else value * 1000


def overlay(path: str, levels: Sequence[Any]) -> None:
    """`bench compare --plot`: aggregate output tok/s (x) against TTFT p95 and TPOT p95 (y),
    one curve per run through its load levels. `levels`: compare_runs.LevelComparison."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = levels[0].runs if levels else []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, title in zip(
        axes, ("ttft_p95", "tpot_p95"), ("TTFT p95", "TPOT p95"), strict=True
    ):
        for run in runs:
            points = [
                (level.values[run]["output_tps"], _ms(level.values[run][key]), level.level)
                for level in levels
                if run in level.values and level.values[run]["output_tps"] is not None
            ]
            if not points:
                continue
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=run)
            for x, y, name in points:
                ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xlabel("aggregate output throughput (tokens/s, all streams)")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title} vs aggregate throughput, per run")
        ax.set_ylim(bottom=0)  # a zoomed axis makes a 2% difference look like 2x
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
