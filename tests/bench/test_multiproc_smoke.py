"""benchmarks/multiproc.py --quick runs end to end: every phase delivers every chunk.

Apart from the relay benchmark's smoke run (test_benchmark_smoke.py), which a parallel run
starts early: its checks wait for that run, this one does not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.paths import ROOT


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
