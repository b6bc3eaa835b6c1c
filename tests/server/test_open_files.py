"""`tokenprobe serve` raises a low open-file limit (proxy/openfiles.py), so it
carries as many streams as the backend behind it, and says at start what it runs with.

Before it did, 150 streams opened at once through a process started with a soft limit
of 128 all failed: 108 answered 502 ("Too many open files") and 42 dropped."""

from __future__ import annotations

import asyncio
import resource
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest

from proxy.openfiles import TARGET, UNLIMITED, OpenFileLimit
from proxy.server.processfigures import open_fds as kernel_counted_fds
from tests.conftest import MODEL, Running
from tests.server.conftest import no_proxy
from tests.servers import free_port, spawn, stop, wait_http

STREAMS = 150
TOKENS = 24


@contextmanager
def serving_with_limit(upstream: str, soft: int, hard: int) -> Iterator[tuple[str, int, list[str]]]:
    """`tokenprobe serve` started under RLIMIT_NOFILE (soft, hard): its URL, its pid and,
    once it has stopped, its stderr lines."""
    port = free_port()

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    process = spawn(
        "serve", "--upstream", upstream, "--port", str(port), "--access-log", "off",
        "--models-refresh", "0", preexec_fn=limit,
    )  # fmt: skip
    lines: list[str] = []
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/healthz")
        yield url, process.pid, lines
    finally:
        stop(process)
        assert process.stderr is not None
        lines += process.stderr.read().decode().splitlines()


def kernel_counts_open_fds() -> bool:
    """Linux 6.2 or later (proxy/server/processfigures.py)."""
    return kernel_counted_fds() is not None


def soft_limit_of(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as limits:
        row = next(line for line in limits if line.startswith("Max open files"))
    return int(row.split()[3])


async def streams(url: str, count: int) -> tuple[list[tuple[int, int]], float | None]:
    """`count` chat streams at once: each one's status and content chunks, and the proxy's
    process_open_fds scraped once every stream has its head (None for a single stream)."""
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    limits = httpx.Limits(max_connections=None)
    heads = 0
    all_heads = asyncio.Event()

    async def one(client: httpx.AsyncClient) -> tuple[int, int]:
        nonlocal heads
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            heads += 1
            if heads == count:
                all_heads.set()
            text = (await response.aread()).decode()
        return response.status_code, text.count('"content":"') - text.count('"content":""')

    async def open_fds(client: httpx.AsyncClient) -> float | None:
        if count == 1:
            return None
        await asyncio.wait_for(all_heads.wait(), 60)
        return scraped(await client.get("/metrics"), "process_open_fds")

    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        fds = asyncio.create_task(open_fds(client))
        results = await asyncio.gather(*(one(client) for _ in range(count)))
        return results, await fds


def scraped(response: httpx.Response, name: str) -> float | None:
    """A sample's value on a /metrics page, None where it is not there."""
    lines = [line for line in response.text.splitlines() if line.startswith(name + " ")]
    return float(lines[0].split()[1]) if lines else None


def test_a_low_soft_limit_is_raised_and_carries_streams_past_it(
    start_sim: Callable[..., Running],
) -> None:
    # A stream lasts 2.6 s: still open at the scrape, made once the last of the 150 heads
    # is in, even where opening them all takes a loaded machine a second or more.
    sim = start_sim(ttft=0.2, tokens_per_second=10.0, output_tokens=TOKENS)
    _, hard_now = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard = 4096 if hard_now == resource.RLIM_INFINITY else min(4096, hard_now)
    with serving_with_limit(sim.url, 128, hard) as (url, pid, lines):
        assert soft_limit_of(pid) == hard
        results, open_fds = asyncio.run(streams(url, STREAMS))
        assert scraped(httpx.get(url + "/metrics"), "process_max_fds") == hard
    assert results == [(200, TOKENS)] * STREAMS
    # Each stream holds two descriptors (the client's, the upstream's): 150 need more
    # than 128, and the process's own figure shows them where the kernel counts them.
    if kernel_counts_open_fds():
        assert open_fds is not None and open_fds >= 2 * STREAMS, open_fds
    else:
        assert open_fds is None
    said = OpenFileLimit(before=128, soft=hard, hard=hard).describe()
    assert f"tokenprobe serve: {said}" in lines, lines


@no_proxy
def test_a_hard_limit_below_the_target_is_said_at_start(
    start_sim: Callable[..., Running],
) -> None:
    sim = start_sim(ttft=0.0, tokens_per_second=1000.0, output_tokens=2)
    with serving_with_limit(sim.url, 200, 200) as (url, pid, lines):
        assert soft_limit_of(pid) == 200
        assert asyncio.run(streams(url, 1)) == ([(200, 2)], None)
    assert (
        "tokenprobe serve: open files: limited to 200 by the hard limit, room for about 68 "
        "concurrent streams; raise the hard limit for more (ulimit -Hn, systemd LimitNOFILE=, "
        "docker --ulimit nofile=)"
    ) in lines, lines


@no_proxy
@pytest.mark.parametrize(
    ("limit", "said"),
    [
        (
            OpenFileLimit(before=1024, soft=TARGET, hard=524288),
            "open files: soft limit raised from 1024 to 65535 (hard 524288), room for about "
            "32,735 concurrent streams",
        ),
        (
            OpenFileLimit(before=1024, soft=TARGET, hard=UNLIMITED),
            "open files: soft limit raised from 1024 to 65535 (hard unlimited), room for "
            "about 32,735 concurrent streams",
        ),
        (
            OpenFileLimit(before=1048576, soft=1048576, hard=1048576),
            "open files: soft limit 1048576 (hard 1048576), room for about 524,256 "
            "concurrent streams",
        ),
        (
            OpenFileLimit(before=UNLIMITED, soft=UNLIMITED, hard=UNLIMITED),
            "open files: soft limit unlimited (hard unlimited), no limit on streams",
        ),
        (
            OpenFileLimit(before=40, soft=40, hard=40),
            "open files: limited to 40 by the hard limit, room for about 0 concurrent "
            "streams; raise the hard limit for more (ulimit -Hn, systemd LimitNOFILE=, "
            "docker --ulimit nofile=)",
        ),
    ],
    ids=["raised", "raised-unlimited-hard", "already-high", "unlimited", "tiny"],
)
def test_the_start_line_says_the_limit_and_the_streams_it_carries(
    limit: OpenFileLimit, said: str
) -> None:
    assert limit.describe() == said
