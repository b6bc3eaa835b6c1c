"""`tokenprobe bench compare RUN.json RUN.json [...]`: which configuration is faster, and by how much.

The first run is the baseline. For each load level: one table, a row per figure, a column
per run, and each later run's change against the baseline with its bootstrap interval
(see significance.py). `--fail-if-worse PCT` turns a confident regression into exit
status 1, for CI. Output quality is not measured: a faster INT4 build may answer worse.

Exit status: 0, 1 when --fail-if-worse found a regression, 2 for bad input (unreadable
files, runs that are not comparable without --force).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from proxy.bench.report import write_json
from proxy.bench.runs import RunError, SavedRun, differences, load
from proxy.bench.significance import BY_NAME, FIGURES, MIN_REQUESTS, Change, compare, rows
from proxy.core import extras

PROG = "tokenprobe bench compare"
DEFAULT_METRICS = ("ttft_p50", "tpot_p50", "output_tps")


@dataclass(frozen=True, slots=True)
class LevelComparison:
    level: str
    runs: list[str]  # labels, baseline first
    values: dict[str, dict[str, float | None]]  # run label -> figure -> value
    changes: dict[str, dict[str, Change]]  # later run label -> figure -> change vs baseline


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Compare saved bench runs (tokenprobe bench --out): per load level, each "
        "run's figures and their change against the first run, with bootstrap intervals.",
    )
    a = p.add_argument
    a("runs", nargs="+", metavar="RUN.json", help="two or more runs; the first is the baseline")
    a("--force", action="store_true", help="compare runs even when their settings differ")
    a(
        "--fail-if-worse",
        type=float,
        metavar="PCT",
        help="exit 1 when a --metric is worse than the baseline by more than PCT percent "
        "(percentage points for shares) with the interval's confidence",
    )
    a(
        "--metric",
        default=",".join(DEFAULT_METRICS),
        help=f"figures --fail-if-worse checks, comma-separated (default {','.join(DEFAULT_METRICS)}; "
        f"any of {', '.join(f.name for f in FIGURES)})",
    )
    a("--confidence", type=float, default=95.0, help="interval coverage in percent (default 95)")
    a(
        "--min-change",
        type=float,
        default=5.0,
        metavar="PCT",
        help="smallest change called a difference, in percent (percentage points for "
        "shares: errors, SLO attainment, ...; default 5): reruns of one setting on one "
        "machine drift by a few percent, which the interval does not see",
    )
    a("--rounds", type=int, default=2000, help="bootstrap resamples (default 2000)")
    a("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    a("--plot", help="overlay chart PNG: throughput vs latency, one curve per run (matplotlib)")
    a("--out", help="write the comparison as JSON")
    return p


def main(argv: Sequence[str]) -> int:
    ns = parser().parse_args(list(argv))
    try:
        if ns.plot and extras.missing("matplotlib"):  # before the runs are read, as bench's
            raise RunError(f"--plot {ns.plot}: " + extras.needs("the chart", "matplotlib", "plot"))
        metrics = _metrics(ns.metric)
        if len(ns.runs) < 2:
            raise RunError("give at least two runs; the first is the baseline")
        if not 50 <= ns.confidence < 100 or ns.rounds < 100 or ns.min_change < 0:
            raise RunError("--confidence must be in [50, 100), --rounds >= 100, --min-change >= 0")
        runs = [load(path) for path in ns.runs]
        _check_labels(runs)
        problems = [d for run in runs[1:] for d in differences(runs[0], run)]
        if problems and not ns.force:
            raise RunError(
                "the runs are not comparable: " + "; ".join(problems) + " (--force compares anyway)"
            )
    except RunError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    for problem in problems:
        print(f"{PROG}: warning: {problem}", file=sys.stderr)
    results = compare_runs(
        runs,
        rounds=ns.rounds,
        confidence=ns.confidence / 100,
        min_change=ns.min_change / 100,
        seed=ns.seed,
    )
    print(render(results, ns.confidence, ns.min_change, ns.rounds, ns.seed))
    if ns.out:
        write_json(ns.out, {"tool": PROG, "runs": ns.runs, "levels": [asdict(r) for r in results]})
    if ns.plot:
        from proxy.bench.plot import overlay

        overlay(ns.plot, results)
        print(f"{PROG}: wrote {ns.plot}", file=sys.stderr)
    if ns.fail_if_worse is not None:
        regressions = regressed(results, metrics, ns.fail_if_worse / 100)
        for line in regressions:
            print(f"{PROG}: regression: {line}", file=sys.stderr)
        if regressions:
            return 1
    return 0


def compare_runs(
    runs: Sequence[SavedRun],
    *,
    rounds: int = 2000,
    confidence: float = 0.95,
    min_change: float = 0.05,
    seed: int = 0,
) -> list[LevelComparison]:
    base = runs[0]
    out = []
    for index, level in enumerate(base.levels):
        base_rows = rows(level.records, base.slo)
        values: dict[str, dict[str, float | None]] = {}
        changes: dict[str, dict[str, Change]] = {}
        for run in runs:
            other = _level(run, level.label, index)
            if other is None:
                continue
            other_rows = rows(other.records, run.slo)
            result = compare(
                base_rows,
                level.duration,
                other_rows,
                other.duration,
                has_slo=bool(base.slo),
                rounds=rounds,
                confidence=confidence,
                min_change=min_change,
                seed=seed + index,
            )
            values[run.label] = {name: c.value for name, c in result.items()}
            if run is not base:
                changes[run.label] = result
        out.append(LevelComparison(level.label, list(values), values, changes))
    return out


def regressed(
    results: Sequence[LevelComparison], metrics: Sequence[str], limit: float
) -> list[str]:
    found = []
    for level in results:
        base = level.runs[0]
        for label, changes in level.changes.items():
            for name in metrics:
                c = changes[name]
                if c.worse_beyond(limit):
                    found.append(
                        f"{level.level}: {label} {BY_NAME[name].title} {_change(c)} vs {base} "
                        f"(worse by more than {limit * 100:g}{'pp' if BY_NAME[name].share else '%'})"
                    )
                elif _lost(c):
                    found.append(
                        f"{level.level}: {label} has no {BY_NAME[name].title}, {base} has "
                        f"{_value(c.base, BY_NAME[name].scale)} {BY_NAME[name].unit} "
                        "(none of its requests gave one: did they all fail?)"
                    )
    return found


def _lost(c: Change) -> bool:
    """The baseline has the figure and the candidate none: a candidate whose every
    request failed has no TTFT, no speed, no throughput, and no interval says worse."""
    return c.base is not None and c.value is None


def render(
    results: Sequence[LevelComparison], confidence: float, min_change: float, rounds: int, seed: int
) -> str:
    blocks = []
    for level in results:
        # A later run's cell is three columns, each aligned on its own: the value and the
        # change right-aligned, the interval or "[n/a: why]" left-aligned. One right-aligned
        # string of all three moved the value and the change with the interval's width.
        header = ["figure", level.runs[0]]
        right = [False, True]
        for label in level.runs[1:]:
            header += [label, "", ""]
            right += [True, True, False]
        table = [header]
        for f in FIGURES:
            if all(level.values[r][f.name] is None for r in level.runs):
                continue  # goodput without --slo
            row = [f"{f.title} ({f.unit})", _value(level.values[level.runs[0]][f.name], f.scale)]
            for label in level.runs[1:]:
                change = level.changes.get(label, {}).get(f.name)
                pct, interval = ("", "") if change is None else _change_parts(change)
                row += [_value(level.values[label][f.name], f.scale), pct, interval]
            table.append(row)
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        lines = [f"level {level.level} (baseline {level.runs[0]})"]
        for row in table:
            lines.append(
                "  ".join(
                    cell.rjust(w) if r else cell.ljust(w)
                    for cell, w, r in zip(row, widths, right, strict=True)
                    if w  # a column empty in every row takes no room
                ).rstrip()
            )
        blocks.append("\n".join(lines))
    legend = (
        f"change vs the baseline [{confidence:g}% bootstrap interval over the per-request "
        f"records, {rounds} resamples, seed {seed}]; shares in percentage points (pp).\n"
        f"worse/better: the interval excludes 0 and the change is at least {min_change:g}% "
        f"({min_change:g} pp for a share); "
        "otherwise the difference is not told apart from noise. The interval covers "
        "request-to-request noise, not run-to-run drift of the machine: rerun to check.\n"
        f"intervals need {MIN_REQUESTS} requests per run and level, p95 ones 100 (5 beyond "
        "the p95); n/a: no interval, and why.\n"
        "Output quality is not measured: compare answers with an evaluation suite."
    )
    return "\n\n".join([*blocks, legend])


def _value(value: float | None, scale: float) -> str:
    return "-" if value is None else f"{value * scale:.1f}" if scale != 1 else f"{value:.1f}"


def _change(c: Change) -> str:
    return " ".join(part for part in _change_parts(c) if part)


def _change_parts(c: Change) -> tuple[str, str]:
    """A change as (the change, its interval and verdict or why it has none)."""
    if c.change is None:
        return "(n/a)", ""
    share = BY_NAME[c.figure].share
    unit = "pp" if share else "%"

    def pct(x: float) -> str:
        return f"{x * 100:+.1f}"

    if c.low is None or c.high is None:
        why = f": {c.reason}" if c.reason else ""
        return f"{pct(c.change)}{unit}", f"[n/a{why}]"
    mark = "" if c.verdict == "same" else f" {c.verdict}"
    return f"{pct(c.change)}{unit}", f"[{pct(c.low)}, {pct(c.high)}]{mark}"


def _level(run: SavedRun, label: str, index: int) -> Any:
    for level in run.levels:
        if level.label == label:
            return level
    # --force across different levels: pair them by position.
    return run.levels[index] if index < len(run.levels) else None


def _metrics(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown or not names:
        raise RunError(
            f"--metric: unknown figure {', '.join(unknown) or text!r}; "
            f"choose from {', '.join(f.name for f in FIGURES)}"
        )
    return names


def _check_labels(runs: Sequence[SavedRun]) -> None:
    seen: dict[str, str] = {}
    for run in runs:
        if run.label in seen:
            raise RunError(
                f"{run.path} and {seen[run.label]} are both labelled {run.label!r}: "
                "rename a file or rerun with a different --label"
            )
        seen[run.label] = run.path
