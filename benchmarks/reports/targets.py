"""Issue 29's targets (issue 20's, with the tail bound at 3 ms where issue 20 had 2), from
one relay.py run over every load shape: met or not, worst first.

Each figure is a ratio of two arms measured in the same run (and, for the sweep, the
same interleaved rounds): tokenprobe-log (metrics + JSON access log, the default data
path) and tokenprobe-full (the same plus tracing of every request) against nginx (one
worker, access log off: the harder comparison). A shape's ratio is the median over
rounds; the headline is the worst shape's.
"""

from __future__ import annotations

from typing import Any

TARGET_ARM = "tokenprobe-log"
TRACED_ARM = "tokenprobe-full"


def _median(stat: dict[str, float] | None) -> float | None:
    return None if not stat else stat["median"]


def _sweep(shape: dict[str, Any], arm: str, streams: int, key: str) -> float | None:
    entry = shape["arms"].get(arm, {}).get("sweep", {}).get(str(streams), {})
    value = entry.get(key)
    return value if value is None or isinstance(value, int | float) else _median(value)


def _row(target: str, goal: str, figure: float | None, met: bool | None, detail: str) -> dict[str, Any]:  # fmt: skip
    return {"target": target, "goal": goal, "figure": figure, "met": met, "detail": detail}


def shape_rows(name: str, shape: dict[str, Any], high: int) -> list[dict[str, Any]]:
    """The per-shape targets: CPU per chunk against nginx, the tail, throughput, stalls."""
    rows = []
    for arm, goal in ((TARGET_ARM, 1.3), (TRACED_ARM, 1.5)):
        for streams in sorted({64, high}):
            mine = _sweep(shape, arm, streams, "cpu_us_per_chunk")
            nginx = _sweep(shape, "nginx", streams, "cpu_us_per_chunk")
            ratio = mine / nginx if mine and nginx else None
            rows.append(
                _row(
                    f"{arm} CPU per chunk vs nginx, {streams} streams [{name}]",
                    f"<= {goal}x",
                    ratio,
                    None if ratio is None else ratio <= goal,
                    "–" if ratio is None else f"{mine:.1f} µs vs {nginx:.1f} µs",
                )
            )
    p99 = _sweep(shape, TARGET_ARM, high, "added_chunk_p99_ms")
    rows.append(
        _row(
            f"{TARGET_ARM} added per-chunk p99, {high} lockstep streams [{name}]",
            "<= 3 ms",
            p99,
            None if p99 is None else p99 <= 3.0,
            "–" if p99 is None else f"{p99:.2f} ms",
        )
    )
    thr = _sweep(shape, TARGET_ARM, high, "throughput_vs_direct")
    rows.append(
        _row(
            f"{TARGET_ARM} throughput vs direct, {high} streams [{name}]",
            ">= 0.995",
            thr,
            None if thr is None else thr >= 0.995,
            "–" if thr is None else f"{thr:.3f}",
        )
    )
    stalled = _sweep(shape, TARGET_ARM, high, "stalled_chunks")
    direct = _sweep(shape, "direct", high, "stalled_chunks")
    rows.append(
        _row(
            f"{TARGET_ARM} stalled chunks (> 1 step late), {high} streams [{name}]",
            "0 (beyond direct's)",
            stalled,
            None if stalled is None else stalled <= (direct or 0),
            f"{stalled} (direct {direct})",
        )
    )
    return rows


def extra_rows(first: dict[str, Any], extras: dict[str, Any]) -> list[dict[str, Any]]:
    """Targets measured once: per request, the co-located backend, WebSockets, memory."""
    arms = first["arms"]
    rows = []
    mine, nginx = (arms.get(a, {}).get("cpu_us_per_request") for a in (TARGET_ARM, "nginx"))
    ratio = mine / nginx if mine and nginx else None
    rows.append(
        _row(
            f"{TARGET_ARM} CPU per non-streaming request vs nginx",
            "<= 2x",
            ratio,
            None if ratio is None else ratio <= 2.0,
            "–" if ratio is None else f"{mine:.0f} µs vs {nginx:.0f} µs",
        )
    )
    side = extras.get("sidecar") or {}
    ratio = side.get("ratio")
    rows.append(
        _row(
            "CPU-bound backend sharing the proxy's core: throughput vs direct",
            ">= 0.95",
            ratio,
            None if ratio is None else ratio >= 0.95,
            side.get("error")
            or f"{side.get('proxied_tok_s', 0):.0f} vs {side.get('direct_tok_s', 0):.0f} tok/s "
            f"(the better of direct {side.get('plain_direct_tok_s', 0):.0f} and through the "
            f"byte relay {side.get('relay_tok_s', 0):.0f})",
        )
    )
    ws = extras.get("websocket") or {}
    mine, nginx = (ws.get(a, {}).get("cpu_us_per_message") for a in ("tokenprobe", "nginx"))
    ratio = mine / nginx if mine and nginx else None
    rows.append(
        _row(
            "WebSocket echo (50 sessions, small messages): CPU per message vs nginx",
            "<= 1.5x",
            ratio,
            None if ratio is None else ratio <= 1.5,
            "–"
            if ratio is None
            else f"{mine:.1f} µs vs {nginx:.1f} µs"
            if mine and nginx
            else ws.get("tokenprobe", {}).get("error", "–"),
        )
    )
    if ratio is None and ws.get("tokenprobe", {}).get("error"):
        rows[-1]["detail"] = f"tokenprobe: {ws['tokenprobe']['error']}"
    rss = {a: arms.get(a, {}).get("rss_mib_per_1000_streams") for a in arms}
    mine, asgi = rss.get(TARGET_ARM), rss.get("tokenprobe-asgi")
    rows.append(
        _row(
            "RSS with 1,000 open streams (MiB), beside nginx's; no worse than the ASGI relay's",
            "<= tokenprobe-asgi",
            mine,
            None if mine is None or asgi is None else mine <= asgi * 1.05,
            ", ".join(f"{a} {v:.1f}" for a, v in rss.items() if v is not None),
        )
    )
    return rows


def issue_targets(shapes: dict[str, dict[str, Any]], extras: dict[str, Any], high: int) -> dict[str, Any]:  # fmt: skip
    """Rows per shape (worst shape first, by the headline ratio), then the once-only rows."""
    per_shape = {name: shape_rows(name, s, high) for name, s in shapes.items()}

    def worst_ratio(name: str) -> float:  # the target arm's CPU per chunk over nginx's
        quoted = f"{TARGET_ARM} CPU per chunk vs nginx"
        rows = per_shape[name]
        figures = [r["figure"] for r in rows if r["target"].startswith(quoted) and r["figure"]]
        return max(figures, default=0.0)

    order = sorted(per_shape, key=worst_ratio, reverse=True)
    rows = [row for name in order for row in per_shape[name]]
    first = next(iter(shapes.values()))
    rows += extra_rows(first, extras)
    headline = None
    if order and worst_ratio(order[0]):
        headline = (
            f"Worst load shape: {order[0]}: {TARGET_ARM} costs {worst_ratio(order[0]):.2f}x "
            f"nginx's CPU per relayed chunk (target <= 1.3x)"
        )
    return {"order": order, "rows": rows, "headline": headline}


def targets_markdown(targets: dict[str, Any]) -> str:
    lines = []
    if targets["headline"]:
        lines += [f"**{targets['headline']}**", ""]
    lines += ["| target | goal | measured | met |", "|---|---|---|---|"]
    for row in targets["rows"]:
        figure = row["figure"]
        shown = "–" if figure is None else f"{figure:.3g}"
        met = "–" if row["met"] is None else ("yes" if row["met"] else "**no**")
        lines.append(f"| {row['target']} | {row['goal']} | {shown} — {row['detail']} | {met} |")
    return "\n".join(lines) + "\n"
