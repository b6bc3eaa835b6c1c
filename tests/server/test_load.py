"""Load: hundreds of concurrent streams through a `tokenprobe serve` process.

The simulator runs in its own process with body hashing on, so every body the client
got is compared byte for byte with what the backend sent (matched by the response id
in the first chunk, which the simulator records). Client, proxy and simulator each
get a process; on a small CI box they share the cores, so the timing bound is
generous and the figures are printed (`pytest -s`).

The short run is part of the default suite; `pytest -m slow` runs the 3-minute one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from proxy.bench.stats import quantile
from tests.paths import ROOT
from tests.servers import free_port, stop, wait_http

CHAT = "/v1/chat/completions"
#: The client asks for usage itself, so the proxy injects nothing: the body it relays
#: must be exactly the simulator's.
BODY = {
    "model": "sim-model",
    "stream": True,
    "stream_options": {"include_usage": True},
    "messages": [{"role": "user", "content": "hi"}],
}
#: The simulator with body hashing and room for every record of a long run (the CLI
#: keeps 10,000).
_SIM = (
    "import sys, uvicorn\n"
    "from proxy.sim.app import create_sim_app\n"
    "from proxy.sim.config import SimConfig\n"
    "config = SimConfig(record_bodies=True, max_records=1_000_000)\n"
    "uvicorn.run(create_sim_app(config), host='127.0.0.1', port=int(sys.argv[1]),\n"
    "            log_level='warning', access_log=False)\n"
)
_ID = re.compile(rb'"id":"([^"]+)"')
#: A chat chunk with generated text; the role-only first chunk has `"content":""`.
_CONTENT = re.compile(rb'"delta":\{"content":"[^"]')


# -- processes ----------------------------------------------------------------------------


@dataclass
class Stack:
    sim_url: str
    url: str  # the proxy's
    proxy: subprocess.Popen[bytes]
    logs: Path

    def log_tail(self) -> str:
        parts = []
        for name in ("sim.log", "proxy.log"):
            text = (self.logs / name).read_text(errors="replace")
            parts.append(f"--- {name} ---\n{text[-2000:]}")
        return "\n".join(parts)

    def sim_digests(self) -> dict[str, str | None]:
        """Response id -> SHA-256 of every body byte the simulator sent, for each chat
        response it completed (one it saw aborted is not a success however it hashes)."""
        records = httpx.get(self.sim_url + "/sim/requests", timeout=60).json()
        done = (r for r in records if r["path"] == CHAT and r["outcome"] == "completed")
        return {r["id"]: r["body_sha256"] for r in done}

    def sim_stats(self) -> dict[str, Any]:
        """active: requests open at the simulator now; max_active: the peak."""
        stats: dict[str, Any] = httpx.get(self.sim_url + "/sim/stats", timeout=10).json()
        return stats

    def sim_active(self) -> int:
        return int(self.sim_stats()["active"])


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=out
        )


@contextlib.contextmanager
def stack(logs: Path, *proxy_args: str) -> Iterator[Stack]:
    """A simulator process and a proxy process in front of it; both stopped at the end."""
    sim_port, port = free_port(), free_port()
    sim = _spawn(["-c", _SIM, str(sim_port)], logs / "sim.log")
    proxy: subprocess.Popen[bytes] | None = None
    try:
        sim_url = f"http://127.0.0.1:{sim_port}"
        wait_http(sim_url + "/health")
        proxy = _spawn(
            ["-m", "proxy", "serve", "--upstream", sim_url, "--port", str(port),
             "--access-log", "off", "--log-level", "warning", *proxy_args],
            logs / "proxy.log",
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/healthz")
        yield Stack(sim_url, url, proxy, logs)
    finally:
        if proxy is not None:
            stop(proxy)
        stop(sim)


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


# -- the client ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Result:
    started: float  # perf_counter() when the request was sent
    status: int
    response_id: str | None
    sha256: str
    ttft: float | None  # request sent -> first read carrying generated text
    error: str | None = None


def sim_headers(ttft: float, tps: float, tokens: int) -> dict[str, str]:
    return {"x-sim-ttft": str(ttft), "x-sim-tps": str(tps), "x-sim-output-tokens": str(tokens)}


def session(concurrency: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=concurrency + 16, force_close=False),
        timeout=aiohttp.ClientTimeout(total=60),
        auto_decompress=False,
    )


async def stream_once(client: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> Result:
    digest = hashlib.sha256()
    head = b""  # the body up to the first token: holds the response id
    ttft = None
    status = 0
    started = time.perf_counter()
    try:
        async with client.post(url + CHAT, json=BODY, headers=headers) as response:
            status = response.status
            async for chunk in response.content.iter_any():
                digest.update(chunk)
                if ttft is None:
                    head += chunk
                    if _CONTENT.search(head):
                        ttft = time.perf_counter() - started
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Result(
            started, status, None, digest.hexdigest(), ttft, f"{type(exc).__name__}: {exc}"
        )
    match = _ID.search(head)
    return Result(started, status, match and match.group(1).decode(), digest.hexdigest(), ttft)


async def keep_streaming(
    url: str, plan: Callable[[random.Random], dict[str, str]], concurrency: int, seconds: float
) -> list[Result]:
    """`concurrency` streams in flight, each followed by the next, until `seconds` pass.

    Each stream's `x-sim-*` headers come from `plan`, and the workers start spread over
    the first second, so streams end and begin at different moments, as real traffic
    does, rather than in waves of `concurrency` at once.
    """
    deadline = time.monotonic() + seconds
    results: list[Result] = []

    async def worker(client: aiohttp.ClientSession, n: int) -> None:
        rng = random.Random(n)
        await asyncio.sleep(n / concurrency)
        while time.monotonic() < deadline:
            results.append(await stream_once(client, url, plan(rng)))

    async with session(concurrency) as client:
        await asyncio.gather(*(worker(client, n) for n in range(concurrency)))
    return results


def corrupted(results: list[Result], digests: dict[str, str | None]) -> list[Result]:
    """Results whose body is not byte-identical to what the simulator sent for that id."""
    return [r for r in results if r.response_id is None or digests.get(r.response_id) != r.sha256]


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1); NaN when there are no values."""
    found = quantile(sorted(values), q * 100)
    return float("nan") if found is None else found


# -- 256 streams --------------------------------------------------------------------------

STREAMS = 256
SIM_TTFT = 0.2
QUANTILES = (("p50", 0.50), ("p99", 0.99), ("max", 1.0))


def stream_plan(rng: random.Random) -> dict[str, str]:
    """About 2 s per stream: 0.2 s to the first token, then 15-25 tokens at 10 tokens/s."""
    return sim_headers(SIM_TTFT, 10, rng.randint(15, 25))


def run_load(logs: Path, seconds: float, warmup: float) -> dict[str, Any]:
    """Stream for `seconds`; memory and TTFT are judged from `warmup` seconds on."""
    with stack(logs) as s:
        pid = s.proxy.pid
        rss: list[tuple[float, int]] = []  # (seconds into the run, KiB)
        t0 = time.perf_counter()

        async def sample_rss() -> None:
            while True:
                rss.append((time.perf_counter() - t0, rss_kib(pid)))
                await asyncio.sleep(1.0)

        async def main() -> list[Result]:
            sampler = asyncio.create_task(sample_rss())
            try:
                return await keep_streaming(s.url, stream_plan, STREAMS, seconds)
            finally:
                sampler.cancel()

        results = asyncio.run(main())
        assert s.proxy.poll() is None, s.log_tail()
        end_rss = rss_kib(pid)
        digests = s.sim_digests()
        stats = s.sim_stats()
        assert stats["active"] == 0, "the simulator still has requests open"

    warm_rss = next(kib for t, kib in rss if t >= warmup)
    errors = [r for r in results if r.error is not None or r.status != 200]
    # Added TTFT: what the client saw minus what the simulator was told to take. An
    # upper bound on the proxy's share: the simulator's and the client's own lateness
    # under load count too.
    steady = [r.ttft - SIM_TTFT for r in results if r.ttft is not None and r.started - t0 >= warmup]
    every = [r.ttft - SIM_TTFT for r in results if r.ttft is not None]
    figures = {
        "seconds": seconds,
        "streams": STREAMS,
        "peak_streams_at_sim": stats["max_active"],
        "requests": len(results),
        "requests_per_s": round(len(results) / seconds, 1),
        "errors": len(errors),
        "first_errors": [r.error or r.status for r in errors[:5]],
        "corrupted": len(corrupted(results, digests)),
        "rss_warm_kib": warm_rss,
        "rss_end_kib": end_rss,
        "rss_max_kib": max(kib for _, kib in rss),
        "added_ttft_ms": {q: round(percentile(steady, p) * 1000, 1) for q, p in QUANTILES},
        "added_ttft_ms_with_warmup": {
            q: round(percentile(every, p) * 1000, 1) for q, p in QUANTILES
        },
    }
    print("\nload:", json.dumps(figures))
    return figures


def check(figures: dict[str, Any]) -> None:
    assert figures["errors"] == 0, figures
    assert figures["corrupted"] == 0, figures
    assert figures["peak_streams_at_sim"] >= STREAMS, figures
    # Flat memory: where it ended up within 10% of where it stood after warm-up.
    assert figures["rss_end_kib"] <= figures["rss_warm_kib"] * 1.10, figures
    # Generous: client, proxy and simulator share two cores here.
    assert figures["added_ttft_ms"]["p99"] < 1000, figures


@pytest.mark.alone("256 streams load both cores; the added TTFT p99 is read within 1 s")
def test_256_concurrent_streams_relay_every_byte_with_flat_memory(tmp_path: Path) -> None:
    # 7 s: every stream's first one has ended by the warm-up's 3 s (they start over the
    # first second and last 1.7-2.7 s), and about 460 requests follow it, each of them
    # judged byte for byte and for memory (10 s took 3 s more of the run's serial tail).
    check(run_load(tmp_path, seconds=7, warmup=3))


@pytest.mark.slow
def test_256_concurrent_streams_for_three_minutes(tmp_path: Path) -> None:
    check(run_load(tmp_path, seconds=180, warmup=30))


# -- the soak script, short -------------------------------------------------------------


def test_short_soak_counts_every_outcome_and_leaks_nothing(tmp_path: Path) -> None:
    """3,000 requests of benchmarks/soak.py's mix: streams, non-streaming, every error
    type, faults and client hang-ups."""
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [sys.executable, "benchmarks/soak.py", "--requests", "3000", "--sample-every", "0.5",
         "--max-seconds", "120", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["requests"] == 3000 and result["wrong_responses"] == 0
    assert result["errors_counted_by_proxy"] == result["errors_sent"]
    assert result["errors_sent"]["client_cancelled"] > 0 and result["errors_sent"]["none"] > 0
    rss, fds, pool = result["rss_kib"], result["fds"], result["upstream_pool"]
    # Idle after warm-up vs idle after the run. The upstream keep-alive pool may grow up
    # to about one idle connection per concurrent request (64; the CI saw 31 after warm-up
    # and 49 at the end), plus a few opened while a finished request's connection was on
    # its way back, so it is counted apart and bounded near the concurrency; every other
    # descriptor must be back where it was: one per cancel or error would be hundreds.
    assert pool["end"] <= result["concurrency"] + 16, pool
    assert (fds["end"] - pool["end"]) - (fds["warm"] - pool["warm"]) <= 4, (fds, pool)
    assert rss["end"] <= rss["warm"] * 1.05, rss
