"""benchmarks/relay.py --quick runs end to end: every arm delivers every chunk, the JSON has its fields.

It starts real processes (the simulator, the load generator, each arm) on loopback ports
and takes under a minute; nginx joins when it is installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "relay.py"

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench")
    run = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--quick",
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
        timeout=200,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert (out / "chart.png").stat().st_size > 0
    assert "| arm |" in (out / "table.md").read_text()
    return json.loads((out / "results.json").read_text())


def test_quick_run_has_every_arm(results: dict) -> None:
    arms = set(results["summary"]["arms"])
    assert {"direct", "relay", "tokenprobe", "tokenprobe-full", "tokenprobe-httpx"} <= arms
    assert not [n for n in results["notes"] if "failed to start" in n]


def test_every_arm_delivered_every_chunk(results: dict) -> None:
    for name, arm in results["summary"]["arms"].items():
        assert arm["chunks"] > 0, name
        assert arm["all_chunks_delivered"], (name, arm["chunks"], arm["expected_chunks"])


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
