"""Soak: many requests through a `tokenprobe serve` process, watching for leaks.

    python benchmarks/soak.py --requests 100000 --out soak.json

A simulator process and a proxy process in front of it, both on loopback ports. The
client sends a fixed, repeating mix (short streams, streams whose usage the proxy
injects and strips, non-streaming requests, every kind of upstream error, faults inside
200 streams, and clients that hang up mid-stream), so the number of each outcome sent
is known exactly, and compares it with what the proxy counted in its /metrics.

The proxy's RSS (/proc/<pid>/status) and open descriptors (/proc/<pid>/fd) are sampled
every few seconds. Leaks show in the idle figures: `warm` is taken after a warm-up
batch, once the client has closed its connections; `end` the same way after the run.
Between them every request of the run has come and gone, so a leak of a few bytes or
one descriptor per request shows as growth. The proxy's idle connections to the
upstream (its keep-alive pool, which may hold one per concurrent request it has seen)
are counted apart, as `upstream_pool`, so they are not taken for a leak.

Exit status: 0 when the proxy's counts equal what was sent, every response looked as
its kind promised and the run finished within --max-seconds; 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from harness import checkout  # noqa: F401  (this checkout's proxy/ first)

from proxy.bench.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
CHAT = "/v1/chat/completions"
DONE = b"data: [DONE]\n\n"
_CONTENT = re.compile(rb'"delta":\{"content":"[^"]')
_REQUESTS = re.compile(r'^tokenprobe_requests_total\{.*error_type="([a-z_]+)".*\} (\S+)$', re.M)
_IN_FLIGHT = re.compile(r"^tokenprobe_requests_in_flight\{.*\} (\S+)$", re.M)


@dataclass(frozen=True)
class Kind:
    """One kind of request in the mix, and what the client and the proxy must see."""

    name: str
    error_type: str  # the proxy's label for it ("none" on success)
    status: int  # what the client must get
    stream: bool = True
    usage: bool = True  # the client asks for usage itself (else the proxy injects it)
    headers: dict[str, str] = field(default_factory=dict)
    cancel: bool = False  # the client hangs up after the first token


def _error(name: str, error_type: str, status: int) -> Kind:
    return Kind(name, error_type, status, stream=False, headers={"x-sim-error": name})


def _fault(fault: str, error_type: str) -> Kind:
    """A 200 stream that breaks after two tokens."""
    return Kind(fault, error_type, 200, headers={"x-sim-fault": fault, "x-sim-fault-after": "2"})


OK_STREAM = Kind("stream", "none", 200)
INJECTED = Kind("stream_usage_injected", "none", 200, usage=False)
NON_STREAM = Kind("non_stream", "none", 200, stream=False)
CANCEL = Kind("client_cancel", "client_cancelled", 200, cancel=True,
              headers={"x-sim-tps": "100", "x-sim-output-tokens": "200"})  # fmt: skip
#: The repeating mix: request i is MIX[i % len(MIX)]. About 2 in 3 succeed.
MIX: tuple[Kind, ...] = (
    *[OK_STREAM] * 10,
    *[INJECTED] * 4,
    *[NON_STREAM] * 5,
    CANCEL,
    CANCEL,
    _error("rate_limit", "rate_limit", 429),
    _error("server_error", "upstream_error", 500),
    _error("html_502", "upstream_error", 502),
    _error("bad_request", "bad_request", 400),
    _error("context_length", "context_length", 400),
    _error("not_found", "not_found", 404),
    _error("auth", "auth", 401),
    _fault("error_event", "stream_error"),
    _fault("close_no_done", "stream_truncated"),
)


def body(kind: Kind) -> dict[str, Any]:
    out: dict[str, Any] = {"model": "sim-model", "stream": kind.stream, "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    if kind.stream and kind.usage:
        out["stream_options"] = {"include_usage": True}
    return out


def looks_right(kind: Kind, status: int, data: bytes) -> str | None:
    """Why a response is not what its kind promised, or None."""
    if status != kind.status:
        return f"status {status}, expected {kind.status}"
    if kind is OK_STREAM and not (data.endswith(DONE) and b'"usage"' in data):
        return "stream did not end with usage and [DONE]"
    if kind is INJECTED and not (data.endswith(DONE) and b'"usage"' not in data):
        return "injected usage was not stripped, or no [DONE]"
    if kind is NON_STREAM and b'"choices"' not in data:
        return "no choices in a non-streamed reply"
    if kind.error_type == "stream_error" and b'"error"' not in data:
        return "no in-stream error event"
    if kind.error_type == "stream_truncated" and data.endswith(DONE):
        return "a truncated stream ended with [DONE]"
    return None


# -- processes ----------------------------------------------------------------------------


def wait_http(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=0.5).status_code < 500:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not come up")


def spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "proxy", *args], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=out)  # fmt: skip


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


@contextlib.contextmanager
def processes(logs: Path) -> Iterator[tuple[str, subprocess.Popen[bytes], int]]:
    """(proxy URL, proxy process, simulator port); both processes stopped at the end."""
    sim_port, port = free_port(), free_port()
    # Fast defaults: a stream of 8 tokens takes ~5 ms, so the proxy is the thing under load.
    sim = spawn(["sim", "--port", str(sim_port), "--ttft", "0.001", "--tps", "2000",
                 "--output-tokens", "8"], logs / "sim.log")  # fmt: skip
    proxy: subprocess.Popen[bytes] | None = None
    try:
        sim_url = f"http://127.0.0.1:{sim_port}"
        wait_http(sim_url + "/health")
        proxy = spawn(["serve", "--upstream", sim_url, "--port", str(port), "--access-log", "off",
                       "--log-level", "warning"], logs / "proxy.log")  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/healthz")
        yield url, proxy, sim_port
    finally:
        if proxy is not None:
            stop(proxy)
        stop(sim)


# -- measuring the proxy --------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    t: float  # seconds since the load began
    rss_kib: int
    fds: int
    pooled: int  # of fds: the proxy's connections to the upstream (its keep-alive pool)
    cpu_s: float


def upstream_sockets(pid: int, upstream_port: int) -> int:
    """How many of the process's descriptors are TCP connections to `upstream_port`.

    The upstream keep-alive pool legitimately grows with the concurrency it has seen
    (up to one idle connection per concurrent request), so a leak check must set it
    apart. /proc/<pid>/net/tcp* lists the namespace's sockets by inode; the process's
    own are the inodes its fds link to."""
    own = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if (link := os.readlink(f"/proc/{pid}/fd/{fd}")).startswith("socket:["):
                own.add(link[8:-1])
    count = 0
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as lines:
            next(lines)  # the header
            for line in lines:
                fields = line.split()  # sl local rem st ... uid timeout inode
                if int(fields[2].rsplit(":", 1)[1], 16) == upstream_port and fields[9] in own:
                    count += 1
    return count


def sample(pid: int, t: float, upstream_port: int) -> Sample:
    with open(f"/proc/{pid}/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return Sample(round(t, 2), rss, fds, upstream_sockets(pid, upstream_port), cpu)


def scrape(url: str) -> tuple[Counter[str], float]:
    """The proxy's finished requests by error type, and its requests in flight."""
    text = httpx.get(url + "/metrics", timeout=10).text
    counted: Counter[str] = Counter()
    for error_type, value in _REQUESTS.findall(text):
        counted[error_type] += int(float(value))
    return counted, sum(float(v) for v in _IN_FLIGHT.findall(text))


def settle(url: str, timeout: float = 10.0) -> Counter[str]:
    """The proxy's counts once nothing is in flight."""
    deadline = time.monotonic() + timeout
    while True:
        counted, in_flight = scrape(url)
        if in_flight == 0 or time.monotonic() > deadline:
            return counted
        time.sleep(0.1)


# -- the client -----------------------------------------------------------------------------


@dataclass
class Tally:
    sent: Counter[str] = field(default_factory=Counter)  # by kind name
    expected: Counter[str] = field(default_factory=Counter)  # by the proxy's error type
    wrong: Counter[str] = field(default_factory=Counter)  # responses not as promised, by kind
    examples: list[str] = field(default_factory=list)

    def miss(self, kind: Kind, why: str) -> None:
        self.wrong[kind.name] += 1
        if len(self.examples) < 10:
            self.examples.append(f"{kind.name}: {why}")


async def one(client: aiohttp.ClientSession, url: str, kind: Kind, tally: Tally) -> None:
    tally.sent[kind.name] += 1
    tally.expected[kind.error_type] += 1
    try:
        async with client.post(url + CHAT, json=body(kind), headers=kind.headers) as response:
            if kind.cancel:
                seen = b""
                async for chunk in response.content.iter_any():
                    seen += chunk
                    if _CONTENT.search(seen):
                        break
                response.close()  # drop the connection mid-stream
                if response.status != kind.status:
                    tally.miss(kind, f"status {response.status}")
                return
            data = await response.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        tally.miss(kind, f"{type(exc).__name__}: {exc}")
        return
    if (why := looks_right(kind, response.status, data)) is not None:
        tally.miss(kind, why)


async def load(url: str, first: int, count: int, concurrency: int, deadline: float, tally: Tally) -> int:  # fmt: skip
    """Send requests first..first+count-1 from `concurrency` workers; return how many went."""
    next_index = first
    end = first + count

    async def worker(client: aiohttp.ClientSession) -> None:
        nonlocal next_index
        while next_index < end and time.monotonic() < deadline:
            i, next_index = next_index, next_index + 1
            await one(client, url, MIX[i % len(MIX)], tally)

    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return next_index - first


async def soak(url: str, pid: int, upstream_port: int, args: argparse.Namespace) -> dict[str, Any]:
    tally = Tally()
    samples: list[Sample] = []
    t0 = time.monotonic()
    deadline = t0 + args.max_seconds

    async def sampler() -> None:
        while True:
            samples.append(sample(pid, time.monotonic() - t0, upstream_port))
            await asyncio.sleep(args.sample_every)

    async def idle_sample() -> Sample:
        # The client has closed its connections; let the proxy notice before looking.
        await asyncio.sleep(1.0)
        return sample(pid, time.monotonic() - t0, upstream_port)

    start = sample(pid, 0.0, upstream_port)
    task = asyncio.create_task(sampler())
    try:
        warmup = min(args.requests, max(200, args.requests // 50))
        sent = await load(url, 0, warmup, args.concurrency, deadline, tally)
        warm = await idle_sample()
        began = time.monotonic()
        sent += await load(url, sent, args.requests - sent, args.concurrency, deadline, tally)
        main_seconds = time.monotonic() - began
    finally:
        task.cancel()
    end = await idle_sample()
    counted = await asyncio.to_thread(settle, url)
    seconds = time.monotonic() - t0
    expected = dict(sorted(tally.expected.items()))
    # the outcomes it counted (a pair's series that start at 0, kept for rate(), are none)
    proxy_counted = {kind: n for kind, n in sorted(counted.items()) if n}
    every = [start, *samples, warm, end]
    return {
        "requests": sent,
        "requested": args.requests,
        "complete": sent == args.requests,
        "concurrency": args.concurrency,
        "seconds": round(seconds, 1),
        "requests_per_s": round((sent - warmup) / main_seconds, 1) if main_seconds > 0 else None,
        "sent_by_kind": dict(sorted(tally.sent.items())),
        "errors_sent": expected,
        "errors_counted_by_proxy": proxy_counted,
        "counts_match": expected == proxy_counted,
        "wrong_responses": sum(tally.wrong.values()),
        "wrong_by_kind": dict(tally.wrong),
        "wrong_examples": tally.examples,
        "rss_kib": _figures("rss_kib", start, warm, end, every),
        "fds": _figures("fds", start, warm, end, every),
        "upstream_pool": _figures("pooled", start, warm, end, every),
        "proxy_cpu_s": round(end.cpu_s - start.cpu_s, 1),
        "samples": [[s.t, s.rss_kib, s.fds] for s in samples],
    }


def _figures(name: str, start: Sample, warm: Sample, end: Sample, every: list[Sample]) -> dict[str, int]:  # fmt: skip
    values = {"start": start, "warm": warm, "end": end}
    return {k: getattr(v, name) for k, v in values.items()} | {"max": max(getattr(s, name) for s in every)}  # fmt: skip


def summary(result: dict[str, Any]) -> str:
    rss, fds, pool = result["rss_kib"], result["fds"], result["upstream_pool"]
    kinds = sorted(set(result["errors_sent"]) | set(result["errors_counted_by_proxy"]))
    rows = [f"  {k:<18} sent {result['errors_sent'].get(k, 0):>7}   proxy counted {result['errors_counted_by_proxy'].get(k, 0):>7}" for k in kinds]  # fmt: skip
    return "\n".join([
        f"requests   {result['requests']} of {result['requested']} in {result['seconds']} s "
        f"({result['requests_per_s']} req/s after warm-up, concurrency {result['concurrency']}, "
        f"proxy CPU {result['proxy_cpu_s']} s)",
        "outcomes (error_type label):", *rows,
        f"counts match: {result['counts_match']}   wrong responses: {result['wrong_responses']}",
        f"RSS KiB    start {rss['start']}  warm {rss['warm']}  end {rss['end']}  max {rss['max']}",
        f"open fds   start {fds['start']}  warm {fds['warm']}  end {fds['end']}  max {fds['max']}",
        f"  of them upstream keep-alive  warm {pool['warm']}  end {pool['end']}  max {pool['max']}",
        *[f"  wrong: {e}" for e in result["wrong_examples"]],
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-seconds", type=float, default=1800.0, help="stop sending after this")  # fmt: skip
    parser.add_argument("--sample-every", type=float, default=3.0, help="seconds between RSS/fd samples")  # fmt: skip
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    args = parser.parse_args(argv)

    with (
        tempfile.TemporaryDirectory(prefix="soak-") as tmp,
        processes(Path(tmp)) as (url, proxy, sim_port),
    ):
        result = asyncio.run(soak(url, proxy.pid, sim_port, args))
        result["proxy_alive"] = proxy.poll() is None
        if not result["proxy_alive"]:
            print((Path(tmp) / "proxy.log").read_text(errors="replace")[-3000:], file=sys.stderr)
    print(summary(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    ok = result["counts_match"] and not result["wrong_responses"] and result["complete"]
    return 0 if ok and result["proxy_alive"] else 1


if __name__ == "__main__":
    sys.exit(main())
