"""`tokenprobe bench --slo` through `tokenprobe serve --slo`: one definition of "met"
(proxy/core/slo.py), so both sides count the same good requests on the same traffic.

The simulator serves two requests at a time (max_num_seqs=2) with a 0.3 s TTFT, so at
concurrency 4 a request's TTFT is ~0.3 s (a slot was free) or ~0.6 s (it queued behind
one): against a 0.45 s target each side of the limit has 0.15 s of room, more than the
one loopback hop by which the bench's clock starts before the proxy's."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import orjson

from tests.conftest import MODEL, Running
from tests.scrape import scrape
from tests.servers import free_port, spawn, stop, wait_http


def _proxy_counts(base: str) -> dict[str, float]:
    series = scrape(base).series("tokenprobe_slo_requests_total")
    return {s.labels["result"]: s.value for s in series}


def test_bench_and_proxy_count_the_same_good_requests(
    start_sim: Callable[..., Running], tmp_path: Path
) -> None:
    sim = start_sim(ttft=0.3, tokens_per_second=100.0, output_tokens=2, max_num_seqs=2)
    port = free_port()
    process = spawn(
        "serve", "--upstream", sim.url, "--port", str(port), "--model-allowlist", MODEL,
        "--models-refresh", "0", "--access-log", "off", "--slo", "ttft=0.45",
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/healthz")
        out = tmp_path / "run.json"
        bench = subprocess.run(
            [sys.executable, "-m", "proxy.bench", "--url", base + "/v1", "--model", MODEL,
             "--out", str(out), "--quiet", "--concurrency", "4", "--requests", "16",
             "--max-tokens", "2", "--slo", "ttft=0.45"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert bench.returncode == 0, bench.stderr
        counts = _proxy_counts(base)
    finally:
        stop(process)
    (summary,) = orjson.loads(out.read_bytes())["summary"]
    assert summary["requests"] == 16 and summary["ok"] == 16
    good = summary["slo_met"]
    assert 0 < good < 16  # both sides of the limit were exercised
    assert counts["met"] == good
    assert counts["ttft"] == 16 - good
    assert counts["error"] == counts["tpot"] == counts["e2e"] == 0
