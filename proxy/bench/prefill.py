"""`--input-tokens 128,1024,4096`: TTFT against prompt length, and the prefill rate it implies.

Implied prefill rate of one request = prompt tokens / TTFT. TTFT also holds queueing, the
network and the first decode step, so this is a lower bound on the backend's prefill
speed; at concurrency 1 and long prompts it comes close. Prompt tokens are the backend's
count (`usage`) when it sends one, else the requested length.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.bench.load import Level
from proxy.bench.stats import distribution

LEGEND = (
    "prefill tok/s: prompt tokens / TTFT per request (median); TTFT includes queueing and "
    "the network, so this is a lower bound on the backend's prefill speed."
)


def rates(level: Level, input_tokens: int) -> list[float]:
    out = []
    for r in level.results:
        m = r.m
        if m.ok and m.ttft:
            out.append((m.prompt_tokens or input_tokens) / m.ttft)
    return out


def table(levels: Sequence[Level], input_tokens: Sequence[int | None]) -> str:
    header = (
        "input tokens",
        "level",
        "prompt tokens",
        "TTFT p50 ms",
        "TTFT p95 ms",
        "prefill tok/s",
    )
    body = []
    for level, n in zip(levels, input_tokens, strict=True):
        if n is None:
            continue
        good = [r.m for r in level.results if r.m.ok]
        ttft = distribution(m.ttft for m in good)
        prompt = distribution(float(m.prompt_tokens) for m in good if m.prompt_tokens is not None)
        rate = distribution(rates(level, n))["p50"]
        body.append(
            (
                str(n),
                level.label.rsplit(" ", 1)[-1],
                "-" if prompt["p50"] is None else f"{prompt['p50']:.0f}",
                _ms(ttft["p50"]),
                _ms(ttft["p95"]),
                "-" if rate is None else f"{rate:.0f}",
            )
        )
    rows = [header, *body]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join([*lines, "", LEGEND])


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"
