"""`tokenprobe bench --workers N` and `--shard I/N`: one load on several processes, merged."""

from __future__ import annotations

import subprocess
import sys
import time
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


@pytest.mark.quiet("a timing read within tens of milliseconds", seconds=2.5)
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


def test_each_shard_sends_the_requests_of_its_own_streams(
    start_sim: StartSim, tmp_path: Path
) -> None:
    """Request j is stream j % concurrency's, and a shard sends its streams' requests: at
    3 streams shard 1/2 has one stream and a third of the requests (an equal share of
    them once kept it running alone at the end, at less concurrency); with more workers
    than streams every request is still sent (at concurrency 1 half of them were not)."""
    url = start_sim(ttft=0.0, tokens_per_second=5000).url + "/v1"
    shard = bench(url, tmp_path / "s.json", "--concurrency", "3", "--requests", "12", "--shard", "1/2")  # fmt: skip
    assert sorted(r["index"] for r in shard["records"]) == [1, 4, 7, 10]
    one = bench(url, tmp_path / "o.json", "--concurrency", "1", "--requests", "6", "--workers", "2")  # fmt: skip
    assert sorted(r["index"] for r in one["records"]) == list(range(6))


def test_workers_merge_records_with_tool_calls_and_engine_metrics(
    start_sim: StartSim, tmp_path: Path
) -> None:
    """The merge reads each record back from its run file: tool calls and the engine's
    per-request metrics come back as the objects the summary reads (they once stayed
    dicts, and every --workers run against vLLM with per-request metrics or tool calls
    failed)."""
    sim = start_sim(ttft=0.01, tokens_per_second=1000)
    run = ("--concurrency", "2", "--requests", "4", "--workers", "2")
    tools = ("--header", "x-sim-tool-calls: 1", "--max-tokens", "50")
    doc = bench(sim.url + "/v1", tmp_path / "tools.json", *run, *tools)
    assert doc["summary"][0]["tool_calls"] == {"complete": 4}, doc["summary"][0]
    doc = bench(sim.url + "/v1", tmp_path / "engine.json", *run, "--header", "x-sim-metrics: 1")
    split = doc["summary"][0]["ttft_split"]
    assert split is not None and split["requests"] == 4, doc["summary"][0]


def test_a_closed_loop_waits_for_its_start_at(start_sim: StartSim, tmp_path: Path) -> None:
    """--start-at ahead of now: the closed loop's streams wait for it as the open loop's
    schedule does (they once started at once, and the level's duration, counted from the
    start instant, came out near zero: billions of requests a second)."""
    sim = start_sim(ttft=0.01, tokens_per_second=1000)
    start = time.time() + 1.5
    doc = bench(sim.url + "/v1", tmp_path / "c.json", "--concurrency", "2", "--requests", "4", "--start-at", str(start))  # fmt: skip
    first = min(r["started_at"] for r in doc["records"])
    assert first >= start - 0.01, first - start
    assert all(r["scheduled"] >= -0.01 for r in doc["records"])
    summary = doc["summary"][0]
    assert summary["duration"] > 0.02 and summary["request_throughput"] < 1000, summary


def test_workers_refuse_a_sweep() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "proxy.bench", "--url", "http://127.0.0.1:9/v1", "--model", MODEL,
         "--concurrency", "1,2", "--workers", "2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "--workers runs one level" in proc.stderr
