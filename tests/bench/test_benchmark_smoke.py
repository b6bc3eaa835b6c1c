"""benchmarks/relay.py --quick runs end to end: every arm delivers every chunk, the JSON has its fields.

It starts real processes (the simulator, the load generator, each arm) on loopback ports,
in two load shapes plus the WebSocket and CPU-bound-backend extras, one round each, and
takes about a minute and a half; nginx joins when it is installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import ROOT

SCRIPT = ROOT / "benchmarks" / "relay.py"

pytestmark = pytest.mark.timeout(360)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench")
    run = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--quick",
            "--shapes",
            "apart,emitter",
            # One round: a smoke run checks that every phase runs and reports, not the
            # spread between rounds (two took 109 s here, one 86 s).
            "--rounds",
            "1",
            # Nor waits for a quiet machine or reruns a phase that other work disturbed:
            # beside the suite's other workers that only made it longer (126 s against 77).
            "--retry-budget",
            "0",
            "--out",
            str(out / "results.json"),
            "--png",
            str(out / "chart.png"),
            "--md",
            str(out / "table.md"),
        ],
        cwd=ROOT / "benchmarks",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert (out / "chart.png").stat().st_size > 0
    assert "| arm |" in (out / "table.md").read_text()
    return json.loads((out / "results.json").read_text())


def test_quick_run_has_every_arm(results: dict) -> None:
    arms = set(results["summary"]["arms"])
    assert {"direct", "relay", "tokenprobe", "tokenprobe-log", "tokenprobe-full"} <= arms
    assert not [n for n in results["notes"] if "failed to start" in n]
    assert set(results["shapes"]) == {"emitter"}
    assert set(results["shapes"]["emitter"]["summary"]["arms"]) == arms


def test_the_targets_table_quotes_every_shape_and_the_extras(results: dict) -> None:
    targets = results["issue_targets"]
    assert set(targets["order"]) == {"apart", "emitter"}
    rows = [r["target"] for r in targets["rows"]]
    for shape in ("apart", "emitter"):
        assert any(f"CPU per chunk vs nginx, 64 streams [{shape}]" in r for r in rows), rows
        assert any("stalled chunks" in r and f"[{shape}]" in r for r in rows), rows
    for once in ("non-streaming request", "CPU-bound backend", "WebSocket echo", "RSS"):
        assert any(once in r for r in rows), (once, rows)
    assert "| target | goal | measured | met |" in results["markdown"]
    ws = results["extras"]["websocket"]
    assert ws["direct"]["messages_per_s"] > 0 and "error" not in ws["direct"]
    if "nginx" in results["summary"]["arms"]:
        assert ws["nginx"]["cpu_us_per_message"] > 0, ws["nginx"]
    side = results["extras"]["sidecar"]
    assert side["direct_tok_s"] > 0 and side["proxied_tok_s"] > 0, side


def test_every_arm_delivered_every_chunk(results: dict) -> None:
    phases = [*results["phases"], *(p for s in results["shapes"].values() for p in s["phases"])]
    for name, arm in results["summary"]["arms"].items():
        assert arm["chunks"] > 0, name
        # On a miss, say why: each phase's failed requests by reason (with the start of the
        # proxy's error body), not only the counts.
        why = [
            (p["op"], p.get("streams"), p.get("error_reasons"))
            for p in phases
            if p.get("arm") == name and p.get("errors")
        ]
        assert arm["all_chunks_delivered"], (name, arm["chunks"], arm["expected_chunks"], why)


def test_results_have_the_reported_fields(results: dict) -> None:
    assert results["machine"]["cpu_model"] and results["machine"]["cores"]
    for name, arm in results["summary"]["arms"].items():
        assert arm["added_ttft_p50_ms"] is not None, name
        for streams in results["config"]["streams"]:
            sweep = arm["sweep"][str(streams)]
            assert sweep["added_chunk_p99_ms"] is not None, (name, streams)
            assert sweep["delivered_per_s"] is not None, (name, streams)
            if name != "direct":
                assert sweep["cpu_us_per_chunk"]["median"] > 0, (name, streams)
        if name != "direct":
            assert arm["cpu_us_per_request"] is not None, name
            assert arm["rss_mib_per_1000_streams"] is not None, name
            assert arm["start_s"]["median"] > 0, name
    assert {t["target"].split(" ")[0] for t in results["summary"]["targets"]} >= {
        "tokenprobe",
        "tokenprobe-full",
    }


# -- the multi-process mode -------------------------------------


def test_multiproc_quick_run_delivers_every_chunk(tmp_path: Path) -> None:
    out = tmp_path / "mp.json"
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "multiproc.py"),
            *("--quick", "--streams", "8", "--workers", "1", "--kinds", "tokenprobe"),
            *("--emitters", "2", "--clients", "2", "--duration", "1", "--tokens", "10"),
            *("--out", str(out)),
        ],
        cwd=ROOT / "benchmarks",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    phases = json.loads(out.read_text())["phases"]
    assert {p["arm"] for p in phases} == {"direct", "tokenprobe x1"}
    for p in phases:
        assert p["errors"] == 0 and p["chunks"] == p["expected_chunks"] > 0, p["arm"]
        if p["arm"] != "direct":
            assert p["cpu_us_per_chunk"] > 0 and p["worker_cores"], p["arm"]
