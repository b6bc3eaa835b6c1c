"""Does an open /ui page cost the streams anything? Five pages' polling against none.

    .venv/bin/python benchmarks/ui_pollers.py [rounds]     # about 70 s a round

`tokenprobe sim` (first token after 50 ms, 50 tokens/s, 100 tokens) behind
`tokenprobe serve`; 16 closed-loop streams for 20 s per arm measure every gap between
network reads as the client sees them. Arms, interleaved each round: no pollers; five
pollers of /metrics every 2 s, staggered, in their own process (what five open /ui pages
send); the same five pollers on /healthz (the pollers' own HTTP and CPU cost without a
/metrics render), so a difference between the last two is the render's.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time

import httpx
from harness import checkout  # noqa: F401  (this checkout's proxy/ first)

from proxy.bench.ports import free_port

STREAMS = 16
SECONDS = 20.0
BODY = {
    "model": "sim-model",
    "stream": True,
    "max_tokens": 100,
    "messages": [{"role": "user", "content": "hi"}],
}
PACE = {"x-sim-ttft": "0.05", "x-sim-tps": "50", "x-sim-output-tokens": "100"}


def spawn(*args: str, stdout: int = subprocess.DEVNULL) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, *args], stdout=stdout, stderr=subprocess.DEVNULL, text=True
    )


def wait_up(url: str) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=0.5).status_code < 500:
                return
        time.sleep(0.05)
    raise SystemExit(f"{url} did not come up")


async def one_stream(client: httpx.AsyncClient, gaps: list[float]) -> None:
    async with client.stream("POST", "/v1/chat/completions", json=BODY, headers=PACE) as r:
        last = None
        async for _ in r.aiter_raw():
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now


async def streams(base: str, seconds: float) -> list[float]:
    gaps: list[float] = []
    end = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=STREAMS * 2)
    async with httpx.AsyncClient(base_url=base, timeout=30, limits=limits) as client:

        async def loop() -> None:
            while time.monotonic() < end:
                await one_stream(client, gaps)

        await asyncio.gather(*(loop() for _ in range(STREAMS)))
    return sorted(gaps)


async def pollers(base: str, path: str, pages: int, seconds: float) -> None:
    """Run in a child process: `pages` pollers of `path`, printing each poll's seconds."""
    times: list[float] = []
    end = time.monotonic() + seconds

    async def poll(offset: float) -> None:
        await asyncio.sleep(offset)
        async with httpx.AsyncClient(base_url=base) as client:
            while time.monotonic() < end:
                start = time.perf_counter()
                await client.get(path)
                times.append(time.perf_counter() - start)
                await asyncio.sleep(2.0)

    await asyncio.gather(*(poll(i * 2.0 / pages) for i in range(pages)))
    print(" ".join(map(str, times)))


def arm(base: str, path: str | None) -> str:
    child = None
    if path is not None:
        child = spawn(__file__, "--poll", base, path, str(SECONDS), stdout=subprocess.PIPE)
    gaps = asyncio.run(streams(base, SECONDS))
    polls = sorted(float(x) for x in child.communicate()[0].split()) if child else []

    def ms(q: float, values: list[float]) -> float:
        return values[int(q * (len(values) - 1))] * 1000 if values else float("nan")

    return (
        f"{path or 'no pollers':>12}: chunk gap p50 {ms(0.5, gaps):6.2f} ms  p99 "
        f"{ms(0.99, gaps):6.2f} ms  p99.9 {ms(0.999, gaps):6.2f} ms  (n={len(gaps)});  "
        f"poll median {ms(0.5, polls):5.2f} ms over {len(polls)}"
    )


def main(rounds: int) -> None:
    sim_port, proxy_port = free_port(), free_port()
    sim = spawn("-m", "proxy", "sim", "--port", str(sim_port))
    upstream = f"http://127.0.0.1:{sim_port}"
    wait_up(upstream + "/health")
    proxy = spawn(
        *("-m", "proxy", "serve", "--upstream", upstream, "--port", str(proxy_port)),
        *("--access-log", "off", "--model-allowlist", "sim-model"),
    )
    base = f"http://127.0.0.1:{proxy_port}"
    try:
        wait_up(base + "/healthz")
        asyncio.run(streams(base, 5.0))  # warm-up
        for n in range(rounds):
            for path in (None, "/metrics", "/healthz"):
                print(f"round {n} {arm(base, path)}", flush=True)
        size = len(httpx.get(base + "/metrics").content)
        print(f"/metrics: {size} bytes")
    finally:
        for process in (proxy, sim):
            process.terminate()
            process.wait(10)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--poll"]:
        asyncio.run(pollers(sys.argv[2], sys.argv[3], 5, float(sys.argv[4])))
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
