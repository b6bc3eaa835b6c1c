"""benchmarks/relay.py --quick runs end to end: every arm delivers every chunk, the JSON has its fields.

It starts real processes (the simulator, the load generator, each arm) on loopback ports,
in two load shapes plus the WebSocket and CPU-bound-backend extras, one round each, and
takes about a minute and a half; nginx joins when it is installed. In a parallel run it
starts as soon as a worker has collected it (`start_quick_run`), and the worker that runs
these checks runs other modules meanwhile: the run mostly waits (a third of a core).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.paths import ROOT
from tests.servers import Started, started_early, wait_early

SCRIPT = ROOT / "benchmarks" / "relay.py"
#: Seconds the run may take from its start.
TIMEOUT = 300

pytestmark = pytest.mark.timeout(360)


def quick_run(out: Path) -> list[str]:
    """The command, writing its results, chart and table in `out`."""
    return [
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
    ]


def start_quick_run(folder: Path) -> Started:
    """The run, started early by the first pytest process of a parallel run
    (tests/conftest.py, `EARLY`), in a process group of its own: stopped, its arms go with
    it. (Not a session: that would be an autogroup, given as much CPU as all the tests.)"""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "stderr").open("wb") as stderr:
        process = subprocess.Popen(
            quick_run(folder),
            cwd=ROOT / "benchmarks",
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            process_group=0,
        )
    return [process], {"out": str(folder), "deadline": time.time() + TIMEOUT}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    early = started_early(start_quick_run)
    if early is None:
        out = tmp_path_factory.mktemp("bench")
        run = subprocess.run(
            quick_run(out),
            cwd=ROOT / "benchmarks",
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        returncode, stderr = run.returncode, run.stderr
    else:
        out, returncode = wait_early(early)
        stderr = (out / "stderr").read_text(errors="replace")
    assert returncode == 0, stderr[-3000:]
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
