"""`tokenprobe bench --workers N` and `--shard I/N`: one load on several processes, merged."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.conftest import MODEL, Running

StartSim = Callable[..., Running]


def bench(url: str, out: Path, *flags: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "proxy.bench", "--url", url, "--model", MODEL, "--out", str(out),
         "--quiet", "--max-tokens", "8", *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return dict(orjson.loads(out.read_bytes()))


@pytest.mark.alone("a timing read within tens of milliseconds")
def test_two_workers_send_one_processes_poisson_schedule(start_sim: StartSim, tmp_path: Path) -> None:  # fmt: skip
    sim = start_sim(ttft=0.01, tokens_per_second=1000)
    url = sim.url + "/v1"
    one = bench(url, tmp_path / "one.json", "--rate", "40", "--requests", "24")
    two = bench(url, tmp_path / "two.json", "--rate", "40", "--requests", "24", "--workers", "2")
    assert [r["index"] for r in two["records"]] == list(range(24))
    by_index = {r["index"]: r["scheduled"] for r in one["records"]}
    assert [r["scheduled"] for r in two["records"]] == pytest.approx(
        [by_index[i] for i in range(24)], abs=1e-9
    )
    assert two["summary"][0]["requests"] == one["summary"][0]["requests"] == 24
    assert all(r["error_type"] is None and r["output_tokens"] == 8 for r in two["records"])
    # Sends on one clock: every request left within a bound of its shared due instant.
    assert max(r["send_delay"] for r in two["records"]) < 0.06


def test_closed_loop_workers_split_the_streams_and_number_requests_apart(
    start_sim: StartSim, tmp_path: Path
) -> None:
    sim = start_sim(ttft=0.01, tokens_per_second=1000)
    doc = bench(sim.url + "/v1", tmp_path / "c.json", "--concurrency", "4", "--requests", "12", "--workers", "2")  # fmt: skip
    assert sorted(r["index"] for r in doc["records"]) == list(range(12))
    assert doc["summary"][0]["ok"] == 12 and doc["config"]["workers"] == 2


def test_workers_refuse_a_sweep() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "proxy.bench", "--url", "http://127.0.0.1:9/v1", "--model", MODEL,
         "--concurrency", "1,2", "--workers", "2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "--workers runs one level" in proc.stderr
