"""benchmarks/reports/targets.py: issue 20's targets from per-shape summaries, worst shape first."""

from __future__ import annotations

import sys
from typing import Any

from tests.paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from reports.targets import issue_targets, targets_markdown


def stat(value: float) -> dict[str, float]:
    return {"median": value, "min": value, "max": value, "n": 1}


def shape(log_us: float, full_us: float, nginx_us: float, p99_ms: float) -> dict[str, Any]:
    def sweep(cpu: float | None, **extra: Any) -> dict[str, Any]:
        return {str(c): {"cpu_us_per_chunk": cpu and stat(cpu), **extra} for c in (64, 256)}

    return {
        "arms": {
            "direct": {"sweep": sweep(None, stalled_chunks=0)},
            "nginx": {"sweep": sweep(nginx_us), "cpu_us_per_request": 70.0,
                      "rss_mib_per_1000_streams": 17.0},
            "tokenprobe-log": {
                "sweep": sweep(log_us, added_chunk_p99_ms=stat(p99_ms),
                               throughput_vs_direct=stat(0.999), stalled_chunks=0),
                "cpu_us_per_request": 130.0,
                "rss_mib_per_1000_streams": 20.0,
            },
            "tokenprobe-full": {"sweep": sweep(full_us)},
            "tokenprobe-asgi": {"sweep": sweep(50.0), "rss_mib_per_1000_streams": 33.0},
        }
    }  # fmt: skip


def test_the_worst_shape_comes_first_and_is_the_headline() -> None:
    shapes = {"apart": shape(24.0, 28.0, 20.0, 1.5), "emitter": shape(30.0, 31.0, 15.0, 3.0)}
    ws_arms = {"nginx": {"cpu_us_per_message": 20.0}, "tokenprobe": {"cpu_us_per_message": 25.0}}
    extras = {
        "sidecar": {"ratio": 0.97, "direct_tok_s": 3000.0, "proxied_tok_s": 2910.0},
        "websocket": ws_arms,
    }
    targets = issue_targets(shapes, extras, 256)
    assert targets["order"] == ["emitter", "apart"]
    # the headline quotes the target arm (2.0x), not the traced one (2.07x)
    assert "emitter" in targets["headline"] and "2.00x" in targets["headline"]
    rows = {r["target"]: r for r in targets["rows"]}
    assert rows["tokenprobe-log CPU per chunk vs nginx, 64 streams [apart]"]["met"] is True
    assert rows["tokenprobe-log CPU per chunk vs nginx, 256 streams [emitter]"]["met"] is False
    assert rows["tokenprobe-log added per-chunk p99, 256 lockstep streams [apart]"]["met"] is True
    assert rows["tokenprobe-log CPU per non-streaming request vs nginx"]["figure"] == 130 / 70
    ws = rows["WebSocket echo (50 sessions, small messages): CPU per message vs nginx"]
    assert ws["figure"] == 1.25 and ws["met"] is True
    rss = next(r for r in targets["rows"] if r["target"].startswith("RSS"))
    assert rss["met"] is True and "nginx 17.0" in rss["detail"]
    assert "| target | goal | measured | met |" in targets_markdown(targets)


def test_one_stream_count_gives_one_row_per_target() -> None:
    targets = issue_targets({"apart": shape(24.0, 28.0, 20.0, 1.5)}, {}, 64)
    names = [r["target"] for r in targets["rows"]]
    assert len(names) == len(set(names))
    missing = [r for r in targets["rows"] if r["target"].startswith("CPU-bound")]
    assert missing[0]["met"] is None  # not measured is not "met"
