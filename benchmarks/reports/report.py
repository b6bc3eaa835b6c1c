"""Turn relay.py's phases into per-arm figures, docs/performance.md's tables, the targets and a chart.

Every "added" figure is the arm's percentile minus direct's percentile in the same round
(or at the same rate), so drift between rounds cancels. Spreads are min-max over rounds.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

TARGETS_NOTE = "tokenprobe = metrics only; tokenprobe-full = metrics + JSON log + tracing"


def stat(given: Iterable[float | None]) -> dict[str, float] | None:
    values = [v for v in given if v is not None]
    if not values:
        return None
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def _p(phase: dict[str, Any] | None, key: str, q: str) -> float | None:
    if phase is None or not phase.get(key):
        return None
    return float(phase[key][q])


def _ms(phase: dict[str, Any] | None, key: str, q: str) -> float | None:
    us = _p(phase, key, q)
    return None if us is None else us / 1000


def passes(kind: str, p: dict[str, Any], direct: dict[str, Any] | None, limit_us: float) -> bool:
    """Does this phase of a rate search hold: nothing lost, and added p99 under the limit?"""
    if "error" in p or p.get("errors", 1) != 0:
        return False
    is_direct = p["arm"] == "direct"
    if kind == "poisson":
        if p["ok"] < 0.99 * p["offered"]:
            return False
        p99, base = _p(p, "latency_us", "p99"), _p(direct, "latency_us", "p99")
    else:
        if p["chunks"] != p["expected_chunks"]:
            return False
        # Holding a rate: p99 in bounds, nothing lost, and no collapse (90% of the rate
        # delivered). Lockstep costs a short request a step whenever its next request comes
        # back late, so how close to 100% an arm delivers has its own column and target.
        if p["delivered_per_s"] < 0.9 * p["offered_per_s"]:
            return False
        p99, base = _p(p, "chunk_latency_us", "p99"), _p(direct, "chunk_latency_us", "p99")
    if p99 is None:
        return False
    if is_direct:
        return p99 < limit_us
    return base is not None and p99 - base < limit_us


def _search(phases: list[dict[str, Any]], arm: str, kind: str) -> dict[str, Any]:
    mine = sorted(
        (p for p in phases if p.get("kind") == kind and p["arm"] == arm), key=lambda p: p["rate"]
    )
    direct = {p["rate"]: p for p in phases if p.get("kind") == kind and p["arm"] == "direct"}
    best, failed_at = None, None
    for p in mine:
        if p.get("pass"):
            best = p["rate"]
        else:
            failed_at = p["rate"]
            break
    generator_failed = min((r for r, p in direct.items() if not p.get("pass")), default=None)
    if failed_at is not None and arm != "direct":
        limit = "arm"
    elif generator_failed is not None:
        limit = "generator"  # direct itself failed at the next rate: the arm was not the limit
    else:
        limit = "not reached (every rate tried held)"
    return {
        "max_rate": best,
        "failed_at": failed_at,
        "direct_failed_at": generator_failed,
        "limited_by": limit,
        "tried": [
            {
                "rate": p["rate"],
                "pass": p.get("pass"),
                "p99_us": _p(
                    p, "latency_us" if kind == "rps-search" else "chunk_latency_us", "p99"
                ),
                "added_p99_us": _added(p, direct.get(p["rate"]), kind),
                "cpu_us_per_unit": _cpu_per(p, "requests" if kind == "rps-search" else "chunks"),
                "proxy_cpu_util": p.get("proxy_cpu_util"),
                "generator_cpu_util": p.get("generator_cpu_util"),
                "delivered_per_s": p.get("delivered_per_s", p.get("achieved_per_s")),
            }
            for p in mine
        ],
    }


def _added(p: dict[str, Any], direct: dict[str, Any] | None, kind: str) -> float | None:
    key = "latency_us" if kind == "rps-search" else "chunk_latency_us"
    a, b = _p(p, key, "p99"), _p(direct, key, "p99")
    return None if a is None or b is None else a - b


def _cpu_per(p: dict[str, Any], unit: str) -> float | None:
    n = p.get(unit) or 0
    return p["proxy_cpu_ns"] / 1000 / n if n and p["arm"] != "direct" else None


def summarize(results: dict[str, Any], limit_us: float) -> dict[str, Any]:
    phases = results["phases"]
    arms = list(results["start_s"])
    streams_list = results["config"]["streams"]
    out: dict[str, Any] = {}
    for arm in arms:
        s: dict[str, Any] = {"sweep": {}}
        for c in streams_list:
            mine = [
                p
                for p in phases
                if p.get("kind") == "sweep" and p["arm"] == arm and p["streams"] == c
            ]
            base = {
                p["round"]: p
                for p in phases
                if p.get("kind") == "sweep" and p["arm"] == "direct" and p["streams"] == c
            }
            pairs = [(p, base.get(p["round"])) for p in mine]
            s["sweep"][str(c)] = {
                "cpu_us_per_chunk": stat([_cpu_per(p, "chunks") for p in mine]),
                "cpu_us_per_chunk_stat": stat(
                    [
                        p["proxy_cpu_stat_ns"] / 1000 / p["chunks"]
                        for p in mine
                        if p["chunks"] and arm != "direct"
                    ]
                ),
                "cpu_us_per_request": stat([_cpu_per(p, "requests") for p in mine]),
                "chunks_per_wakeup": stat(
                    [p["chunks"] / p["proxy_wakeups"] for p in mine if p.get("proxy_wakeups")]
                ),
                "proxy_cpu_util": stat([p["proxy_cpu_util"] for p in mine]),
                "generator_cpu_util": stat([p["generator_cpu_util"] for p in mine]),
                "chunk_p50_ms": stat(
                    [_ms(p, "chunk_latency_us", "p50") for p in mine if p.get("chunk_latency_us")]
                ),
                "chunk_p99_ms": stat(
                    [_ms(p, "chunk_latency_us", "p99") for p in mine if p.get("chunk_latency_us")]
                ),
                "added_chunk_p50_ms": stat(
                    [_diff(p, d, "chunk_latency_us", "p50") for p, d in pairs]
                ),
                "added_chunk_p99_ms": stat(
                    [_diff(p, d, "chunk_latency_us", "p99") for p, d in pairs]
                ),
                "delivered_per_s": stat([p["delivered_per_s"] for p in mine]),
                "delivered_over_offered": stat(
                    [
                        p["delivered_per_s"] / p["offered_per_s"]
                        for p in mine
                        if p.get("offered_per_s")
                    ]
                ),
                "throughput_vs_direct": stat(
                    [
                        p["delivered_per_s"] / d["delivered_per_s"]
                        for p, d in pairs
                        if d and d["delivered_per_s"]
                    ]
                ),
                "chunks": sum(p["chunks"] for p in mine),
                "stalled_chunks": sum(p.get("stalled_chunks") or 0 for p in mine),
                "expected_chunks": sum(p["expected_chunks"] for p in mine),
                "errors": sum(p["errors"] for p in mine),
            }
        ttft = [p for p in phases if p.get("kind") == "ttft" and p["arm"] == arm]
        tbase = {p["round"]: p for p in phases if p.get("kind") == "ttft" and p["arm"] == "direct"}
        s["ttft_p50_ms"] = stat([_ms(p, "ttft_us", "p50") for p in ttft if p.get("ttft_us")])
        s["added_ttft_p50_ms"] = stat(
            [_diff(p, tbase.get(p["round"]), "ttft_us", "p50") for p in ttft]
        )
        s["added_ttft_p99_ms"] = stat(
            [_diff(p, tbase.get(p["round"]), "ttft_us", "p99") for p in ttft]
        )
        measured = [p for p in phases if p.get("kind") in ("sweep", "ttft") and p["arm"] == arm]
        s["all_chunks_delivered"] = bool(measured) and all(
            "error" not in p and p["errors"] == 0 and p["chunks"] == p["expected_chunks"]
            for p in measured
        )
        s["chunks"] = sum(p.get("chunks", 0) for p in measured)
        s["expected_chunks"] = sum(p.get("expected_chunks", 0) for p in measured)
        s["rps_search"] = _search(phases, arm, "rps-search")
        s["chunk_search"] = _search(phases, arm, "chunk-search")
        # Per request: the median over the request rates the arm held (at the lowest rate,
        # idle wake-ups weigh on one phase alone).
        held = [t["cpu_us_per_unit"] for t in s["rps_search"]["tried"] if t["pass"]]
        tried = [t["cpu_us_per_unit"] for t in s["rps_search"]["tried"]]
        per_request = [v for v in (held or tried[:1]) if v is not None]
        s["cpu_us_per_request"] = statistics.median(per_request) if per_request else None
        mem = [p for p in phases if p.get("op") == "hold" and p["arm"] == arm]
        s["rss_mib_per_1000_streams"] = mem[0]["rss_mib_per_1000"] if mem else None
        s["memory_streams_ok"] = (mem[0]["ok"], mem[0]["streams"]) if mem else None
        starts = results["start_s"].get(arm) or []
        s["start_s"] = stat(starts)
        out[arm] = s
    results_targets = targets(out, streams_list)
    return {"arms": out, "targets": results_targets, "headline_streams": headline(streams_list)}


def _diff(p: dict[str, Any], d: dict[str, Any] | None, key: str, q: str) -> float | None:
    a, b = _p(p, key, q), _p(d, key, q)
    return None if a is None or b is None else (a - b) / 1000


def headline(streams_list: list[int]) -> int:
    return 64 if 64 in streams_list else max(streams_list)


def _med(s: dict[str, float] | None) -> float | None:
    return None if s is None else s["median"]


def targets(arms: dict[str, Any], streams_list: list[int]) -> list[dict[str, Any]]:
    """The project's performance targets, each with the figure measured against it."""
    c = str(headline(streams_list))
    top = str(max(streams_list))
    out: list[dict[str, Any]] = []

    def add(name: str, target: str, value: float | None, ok: bool | None, detail: str = "") -> None:
        out.append({"target": name, "goal": target, "measured": value, "met": ok, "detail": detail})

    def cpu_chunk(arm: str) -> float | None:
        return _med(arms.get(arm, {}).get("sweep", {}).get(c, {}).get("cpu_us_per_chunk"))

    # Issue 15: CPU per chunk against nginx (1 worker each) at 64 and 256 lockstep streams.
    for streams in [s for s in streams_list if s >= 64]:
        sweep = {a: arms.get(a, {}).get("sweep", {}).get(str(streams), {}) for a in arms}
        base = _med(sweep.get("nginx", {}).get("cpu_us_per_chunk"))
        for arm, limit in (("tokenprobe", 1.5), ("tokenprobe-full", 1.8)):
            mine = _med(sweep.get(arm, {}).get("cpu_us_per_chunk"))
            if arm not in arms or mine is None or not base:
                continue
            add(
                f"{arm} CPU per chunk vs nginx ({streams} streams)",
                f"<= {limit}x",
                mine / base,
                mine / base <= limit,
                f"{mine:.1f} us vs {base:.1f} us",
            )
    relay = cpu_chunk("relay")
    for arm, limit in (("tokenprobe", 1.75), ("tokenprobe-full", 2.25)):
        mine = cpu_chunk(arm)
        ratio = mine / relay if mine is not None and relay else None
        add(
            f"{arm} CPU per chunk vs byte relay ({c} streams)",
            f"<= {limit}x",
            ratio,
            None if ratio is None else ratio <= limit,
            "" if ratio is None else f"{mine:.1f} us vs {relay:.1f} us",
        )
    tp = arms.get("tokenprobe", {})
    v = _med(tp.get("added_ttft_p50_ms"))
    add("tokenprobe added TTFT p50, 1 stream", "< 1 ms", v, None if v is None else v < 1.0)
    v = _med(tp.get("sweep", {}).get(top, {}).get("throughput_vs_direct"))
    add(
        f"tokenprobe throughput vs direct ({top} streams)",
        ">= 99%",
        v,
        None if v is None else v >= 0.99,
    )
    v = _med(tp.get("sweep", {}).get(top, {}).get("added_chunk_p99_ms"))
    add(
        f"tokenprobe added per-chunk p99 ({top} lockstep streams, 1 worker)",
        "< 5 ms",
        v,
        None if v is None else v < 5.0,
    )
    search = tp.get("chunk_search") or {}
    rate = search.get("max_rate")
    held = [t for t in search.get("tried", []) if t["rate"] == rate]
    per_chunk = held[0]["cpu_us_per_unit"] if held else cpu_chunk("tokenprobe")
    ceiling = 1e6 / per_chunk if per_chunk else None
    detail = f"limited by {search.get('limited_by')}"
    if held:
        detail += (
            f"; at {rate:,.0f}/s the proxy used {held[0]['proxy_cpu_util']:.2f} core, "
            f"the simulator + load generator {held[0]['generator_cpu_util']:.2f} core"
        )
    if ceiling:
        detail += f"; CPU-bound ceiling 1e6 / {per_chunk:.1f} us = {ceiling:,.0f} chunks/s per core"
    add(
        "tokenprobe sustainable chunk rate, added p99 < 5 ms",
        ">= 14,000 chunks/s",
        rate,
        None
        if rate is None
        else (
            True if rate >= 14000 else (None if search.get("limited_by") == "generator" else False)
        ),
        detail,
    )
    v = _med(tp.get("start_s"))
    add(
        "tokenprobe start to first request (no tokenizer)",
        "< 1 s",
        v,
        None if v is None else v < 1.0,
    )
    return out


# -- the markdown ----------------------------------------------------------------------------------


def _fmt(
    s: dict[str, float] | None, scale: float = 1.0, digits: int = 2, spread: bool = True
) -> str:
    if s is None:
        return "–"
    m = f"{s['median'] * scale:.{digits}f}"
    if spread and s.get("n", 1) > 1:
        m += f" ({s['min'] * scale:.{digits}f}–{s['max'] * scale:.{digits}f})"
    return m


def _rate(search: dict[str, Any]) -> str:
    r = search.get("max_rate")
    if not search.get("tried"):
        return "–"
    text = "none" if r is None else f"{r:,.0f}"
    if search.get("limited_by") == "generator":
        text = f">= {text} (gen.)" if r is not None else "– (gen.)"
    elif search.get("limited_by", "").startswith("not reached"):
        text = f">= {text}"
    return text


def markdown(results: dict[str, Any]) -> str:
    m, summ = results["machine"], results["summary"]
    arms = summ["arms"]
    c = str(summ["headline_streams"])
    top = str(max(results["config"]["streams"]))
    cfg = results["config"]
    relay = _med(arms.get("relay", {}).get("sweep", {}).get(c, {}).get("cpu_us_per_chunk"))
    lines = [
        f"Machine: {m['cpu_model']}, {m['cores']} cores, Python {m['python']}, Linux {m['kernel']}. "
        f"Arm on core {results['cores']['proxy']}, simulator and load generator on "
        f"{sorted(set(results['cores']['simulator']) | set(results['cores']['load_generator']))}"
        f"{' (one process)' if cfg.get('shape') == 'together' else ' (two processes)'}. "
        f"Lockstep step {cfg['step_ms']:g} ms, {cfg['tokens']} chunks per request, "
        f"{cfg['rounds']} interleaved rounds: median (min–max).",
        "",
        f"| arm | CPU µs/chunk ({c} str.) | × relay | CPU µs/request (non-stream, median over rates held) | added TTFT p50 / p99 ms (1 str.) "
        f"| added chunk p50 / p99 ms ({top} str.) | throughput vs direct (delivered/offered), {top} str. | every chunk delivered "
        f"| max chunks/s, added p99 < 5 ms ({cfg['search_streams']} str.) | max req/s, added p99 < 5 ms "
        f"| RSS MiB / 1k open streams | start → first request s |",
        "|" + "---|" * 12,
    ]
    for name, s in arms.items():
        sw = s["sweep"].get(c, {})
        swt = s["sweep"].get(top, {})
        mine = _med(sw.get("cpu_us_per_chunk"))
        ratio = f"{mine / relay:.2f}" if mine is not None and relay else "–"
        direct = name == "direct"
        lines.append(
            "| "
            + " | ".join(
                [
                    name,
                    "–" if direct else _fmt(sw.get("cpu_us_per_chunk"), digits=1),
                    "–" if direct else ratio,
                    "–"
                    if direct or s["cpu_us_per_request"] is None
                    else f"{s['cpu_us_per_request']:.0f}",
                    "0 (baseline)"
                    if direct
                    else f"{_fmt(s['added_ttft_p50_ms'], spread=False)} / {_fmt(s['added_ttft_p99_ms'], spread=False)}",
                    "0 (baseline)"
                    if direct
                    else f"{_fmt(swt.get('added_chunk_p50_ms'), spread=False)} / {_fmt(swt.get('added_chunk_p99_ms'))}",
                    (
                        "1"
                        if direct
                        else _fmt(swt.get("throughput_vs_direct"), digits=3, spread=False)
                    )
                    + f" ({_fmt(swt.get('delivered_over_offered'), digits=3, spread=False)})",
                    f"{'yes' if s['all_chunks_delivered'] else 'NO'} ({s['chunks']:,}/{s['expected_chunks']:,})",
                    _rate(s["chunk_search"]),
                    _rate(s["rps_search"]),
                    "–"
                    if s["rss_mib_per_1000_streams"] is None
                    else f"{s['rss_mib_per_1000_streams']:.1f}",
                    "–" if direct else _fmt(s["start_s"], spread=False),
                ]
            )
            + " |"
        )
    lines += [
        "",
        "Per concurrency: proxy CPU µs per chunk / added per-chunk p99 ms (median over rounds).",
        "",
    ]
    streams = [str(x) for x in cfg["streams"]]
    lines.append("| arm | " + " | ".join(f"{x} streams" for x in streams) + " |")
    lines.append("|" + "---|" * (len(streams) + 1))
    for name, s in arms.items():
        if name == "direct":
            cells = [
                f"– / p99 {_fmt(s['sweep'][x]['chunk_p99_ms'], spread=False)} (abs.)"
                for x in streams
            ]
        else:
            cells = [
                f"{_fmt(s['sweep'][x]['cpu_us_per_chunk'], digits=1, spread=False)} / {_fmt(s['sweep'][x]['added_chunk_p99_ms'], spread=False)}"
                for x in streams
            ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Targets (" + TARGETS_NOTE + "):",
        "",
        "| target | goal | measured | met |",
        "|---|---|---|---|",
    ]
    for t in summ["targets"]:
        v = t["measured"]
        shown = (
            "–" if v is None else (f"{v:.3f}" if isinstance(v, float) and v < 100 else f"{v:,.0f}")
        )
        met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
        lines.append(
            f"| {t['target']} | {t['goal']} | {shown}{' — ' + t['detail'] if t['detail'] else ''} | {met} |"
        )
    gen = arms.get("direct", {}).get("sweep", {}).get(top, {}).get("generator_cpu_util")
    if gen is not None:
        lines.append(
            f"\nSimulator + load generator CPU at {top} streams (direct): {_fmt(gen)} cores "
            f"of the {len(results['cores']['simulator'])} they share."
        )
    contended = [p for p in results["phases"] if p.get("foreign_cpu_cores", 0) > cfg["max_foreign"]]
    measured = [p for p in results["phases"] if "foreign_cpu_cores" in p]
    retried = sum(p.get("retries", 0) for p in measured)
    lines.append(
        f"\nShared machine: {retried} phases rerun because other processes used more than "
        f"{cfg['max_foreign']} cores during them; {len(contended)} of {len(measured)} kept "
        "phases still had such load (retry budget spent)."
    )
    for note in results["notes"]:
        lines.append(f"\nNote: {note}")
    return "\n".join(lines) + "\n"


# -- the chart -------------------------------------------------------------------------------------


def chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = {k: v for k, v in results["summary"]["arms"].items() if k != "direct"}
    streams = [str(x) for x in results["config"]["streams"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(arms))
    for i, (name, s) in enumerate(arms.items()):
        xs = [j + i * width for j in range(len(streams))]
        cpu = [_med(s["sweep"][x]["cpu_us_per_chunk"]) or 0 for x in streams]
        p99 = [_med(s["sweep"][x]["added_chunk_p99_ms"]) or 0 for x in streams]
        ax1.bar(xs, cpu, width, label=name)
        ax2.bar(xs, p99, width, label=name)
    for ax in (ax1, ax2):
        ax.set_xticks(
            [j + 0.4 - width / 2 for j in range(len(streams))], [f"{x} streams" for x in streams]
        )
    ax1.set_ylabel("proxy CPU µs per relayed chunk")
    ax2.set_ylabel("added per-chunk latency p99, ms")
    ax2.axhline(5.0, color="grey", linestyle="--", linewidth=1)
    ax2.set_yscale("symlog", linthresh=1.0)  # 0.1 ms and 300 ms on one axis
    top = max((b.get_height() for b in ax2.patches), default=5.0)
    ax2.set_ylim(-0.5, max(top, 5.0) * 2)  # a negative "added" is noise around direct
    ax1.legend(fontsize=8)
    m = results["machine"]
    fig.suptitle(
        f"tokenprobe relay cost — {m['cpu_model']}, lockstep {results['config']['step_ms']:g} ms"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
