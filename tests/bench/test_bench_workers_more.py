"""`tokenprobe bench --workers N` reports as one process does: Ctrl-C and SIGTERM write what
was measured (exit 130), --plot draws, and the cost and --compare-metrics blocks are the
whole run's, not the first worker's share.

The simulator, the proxy and the bench each run as a process of their own, as they do
for real: the signals go to the bench's process group (a terminal's Ctrl-C) or to its
parent process alone (a service manager's SIGTERM).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import MODEL
from tests.servers import free_port, spawn, stop, wait_http

#: Long enough that every interrupt lands in the middle of the run.
ENDLESS = ("--concurrency", "4", "--requests", "2000", "--max-tokens", "10")


@pytest.fixture(scope="module")
def sim_url() -> Iterator[str]:
    """A simulator process: 50 ms to the first token, 10 tokens in about 100 ms."""
    port = free_port()
    sim = spawn("sim", "--port", str(port), "--model", MODEL, "--ttft", "0.05", "--tps", "200")
    try:
        wait_http(f"http://127.0.0.1:{port}/health")
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(sim)


def start_bench(sim_url: str, tmp_path: Path, *flags: str) -> subprocess.Popen[str]:
    """`bench --workers 2` in a process group of its own, SIGINT at its default (a test
    runner's background process may inherit it ignored), its temporary files in tmp_path."""
    return subprocess.Popen(
        [sys.executable, "-m", "proxy.bench", "--url", sim_url + "/v1", "--model", MODEL,
         "--quiet", "--workers", "2", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, process_group=0,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip


def wait_for_completed(sim_url: str, count: int, timeout: float = 20.0) -> None:
    """Until the simulator has served `count` requests whole since its reset."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        requests = httpx.get(sim_url + "/sim/requests", timeout=5).json()
        if sum(r["outcome"] == "completed" for r in requests) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"the simulator did not complete {count} requests")


def interrupted(sim_url: str, tmp_path: Path, send: str) -> tuple[int, str, str, dict[str, Any]]:
    """Run the bench until it has measured some requests, then `send` SIGINT to its group
    or SIGTERM to its parent; its exit status, stdout, stderr and run file."""
    httpx.post(sim_url + "/sim/reset", timeout=5)
    out = tmp_path / "run.json"
    bench = start_bench(sim_url, tmp_path, *ENDLESS, "--out", str(out))
    try:
        wait_for_completed(sim_url, 8)
        if send == "SIGINT to the group":
            os.killpg(bench.pid, signal.SIGINT)
        else:
            bench.send_signal(signal.SIGTERM)
        stdout, stderr = bench.communicate(timeout=15)
    finally:
        if bench.poll() is None:
            bench.terminate()  # its workers go down with it, or after its grace
            try:
                bench.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(bench.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):  # workers its death left running
            os.killpg(bench.pid, signal.SIGKILL)
    assert out.exists(), f"no run file; exit status {bench.returncode}; {stderr}"
    return bench.returncode, stdout, stderr, orjson.loads(out.read_bytes())


@pytest.mark.parametrize("send", ["SIGINT to the group", "SIGTERM to the parent"])
def test_an_interrupted_workers_run_writes_what_was_measured(
    sim_url: str, tmp_path: Path, send: str
) -> None:
    """The workers write their shares and the parent merges them, as one process writes its
    own (the parent once killed its workers while they wrote, and SIGTERM left them running
    on, their temporary folder behind)."""
    rc, stdout, stderr, doc = interrupted(sim_url, tmp_path, send)
    assert rc == 130 and "Traceback" not in stderr, stderr
    assert "interrupted; reporting what was measured" in stderr
    assert doc["status"] == "interrupted" and doc["config"]["workers"] == 2
    records = doc["records"]
    assert 8 <= len(records) < 2000 and all(r["error_type"] is None for r in records)
    assert doc["summary"][0]["requests"] == len(records)
    assert "c=4" in stdout
    assert not list(tmp_path.glob("tokenprobe-workers-*"))


@pytest.fixture(scope="module")
def proxy_metrics(sim_url: str) -> Iterator[tuple[str, str]]:
    """A proxy process in front of the simulator: its URL and its /metrics URL."""
    port, metrics = free_port(), free_port()
    proxy = spawn(
        "serve", "--upstream", sim_url, "--port", str(port), "--metrics-port", str(metrics),
        "--access-log", "off",
    )  # fmt: skip
    try:
        wait_http(f"http://127.0.0.1:{metrics}/metrics")
        yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics}/metrics"
    finally:
        stop(proxy)


def finished(url: str, tmp_path: Path, *flags: str) -> tuple[str, dict[str, Any]]:
    """A whole `bench --workers 2` run of 12 requests: its stdout and run file."""
    out = tmp_path / "run.json"
    bench = start_bench(url, tmp_path, "--concurrency", "4", "--requests", "12",
                        "--max-tokens", "8", "--out", str(out), *flags)  # fmt: skip
    try:
        stdout, stderr = bench.communicate(timeout=60)
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
    assert bench.returncode == 0, stderr
    return stdout, orjson.loads(out.read_bytes())


def test_workers_draw_the_plot(sim_url: str, tmp_path: Path) -> None:
    """--plot was taken from the workers and never drawn by the parent: no chart, exit 0."""
    pytest.importorskip("matplotlib")
    chart = tmp_path / "chart.png"
    finished(sim_url, tmp_path, "--plot", str(chart))
    assert chart.read_bytes().startswith(b"\x89PNG")


def test_the_cost_of_a_workers_run_is_the_whole_runs(sim_url: str, tmp_path: Path) -> None:
    """The first worker's cost was saved: half the tokens in the same time, twice the
    price the table printed."""
    _, doc = finished(sim_url, tmp_path, "--cost-per-hour", "10")
    s = doc["summary"][0]
    assert s["output_tokens"] == 12 * 8
    whole = 10 / (s["output_tokens"] / s["duration"] * 3600) * 1e6
    assert doc["cost"]["per_million_tokens"][s["label"]]["output"] == pytest.approx(whole)


def test_compare_metrics_sets_the_whole_run_against_the_proxy(
    proxy_metrics: tuple[str, str], tmp_path: Path
) -> None:
    """Each worker scraped the proxy around its own share: the file set the first worker's
    6 requests against the 12 the proxy saw (a false 2x mismatch), and no table was
    printed. The parent scrapes once around the whole run."""
    url, metrics = proxy_metrics
    stdout, doc = finished(url, tmp_path, "--compare-metrics", metrics)
    assert doc["compare"]["bench"]["requests"] == doc["compare"]["proxy"]["requests"] == 12
    assert "bench vs proxy (--compare-metrics)" in stdout


@pytest.mark.parametrize("send", [signal.SIGHUP, signal.SIGKILL], ids=["SIGHUP", "SIGKILL"])
def test_no_worker_outlives_its_parent(sim_url: str, tmp_path: Path, send: int) -> None:
    """A dropped ssh session (SIGHUP to the parent alone: the workers have a process group
    of their own) or a parent killed outright: the workers went on loading the backend
    until their run ended (22 requests in the 8 s after)."""
    httpx.post(sim_url + "/sim/reset", timeout=5)
    bench = start_bench(sim_url, tmp_path, *ENDLESS)
    try:
        wait_for_completed(sim_url, 8)
        bench.send_signal(send)
        bench.wait(15)
        time.sleep(1.0)  # the workers' last requests end or are cut
        before = len(httpx.get(sim_url + "/sim/requests", timeout=5).json())
        time.sleep(1.5)
        after = len(httpx.get(sim_url + "/sim/requests", timeout=5).json())
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(bench.pid, signal.SIGKILL)
    assert after == before, f"{after - before} requests after the parent ended"
