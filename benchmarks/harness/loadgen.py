"""The benchmark's load generator: a lean HTTP/1.1 client on uvloop, raw asyncio and httptools.

It runs in its own process and takes commands from relay.py, one JSON object a line on
stdin, answering each with one JSON line on stdout (a `hold` also reports `open` first).
Per-chunk latency comes from the backend's stamps: every content chunk carries the
`time.time_ns()` taken just before the backend wrote it (the text's opening `"@N"`, from
the simulator and emitter.py alike; a `"sent_ns": N` first key also reads), and the
client notes `time.time_ns()` when the network read carrying it arrived.

Commands (all times in seconds):
  stream   N keep-alive connections, each streaming requests back to back for `duration`
  poisson  open-loop non-streaming requests at `rate` per second for `duration`
  hold     open N streams that stay open `hold` seconds (memory per open stream)
  quit
"""

from __future__ import annotations

import asyncio
import random
import re
import sys
import time
from typing import Any

import httptools
import orjson

from harness import checkout  # noqa: F401  (this checkout's proxy/ first)
from proxy.bench.stats import quantile

#: A send stamp: a `sent_ns` key (the simulator's `x-sim-stamp: 1`), or `@<time_ns>` opening
#: a text (emitter.py; the simulator's `stamp_in_text`, chat, completions, Messages, Responses).
STAMP = re.compile(rb'(?:"sent_ns":|"(?:content|text|delta)":"@)(\d+)')
MAX_CONNECTIONS = 4096
ANSWER_BYTES = 160  # of a non-200 body kept for its error reason
BURN_NS = [0]  # CPU to burn per content chunk read, set per stream phase


class Stats:
    """What one phase saw. Latencies in ns."""

    def __init__(self, win_start: int = 0, win_end: int = 0) -> None:
        self.chunk_lat: list[int] = []
        self.ttft: list[int] = []
        self.latency: list[int] = []
        self.requests = 0
        self.ok = 0
        self.errors = 0
        self.chunks = 0
        self.expected = 0
        self.win_start = win_start
        self.win_end = win_end
        self.win_chunks = 0
        self.win_requests = 0
        self.why: dict[str, int] = {}  # error reasons seen, for the report

    def failed(self, reason: str) -> None:
        self.errors += 1
        if reason in self.why or len(self.why) < 20:
            self.why[reason] = self.why.get(reason, 0) + 1


class Conn(asyncio.Protocol):
    """One keep-alive connection, one request at a time."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.head: asyncio.Future[None] | None = None
        self.stats = Stats()
        self.lost = False
        self.keep = True
        self.now = 0
        self.status = 0
        self.stamps = 0
        self.first = 0
        self.done_at = 0
        self.tail = b""
        self.answer = b""  # the start of a non-200 body: the proxy's error says why

    # -- asyncio ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        for fut in (self.waiter, self.head):
            if fut is not None and not fut.done():
                fut.set_exception(ConnectionError("connection closed"))

    def data_received(self, data: bytes) -> None:
        self.now = time.time_ns()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.lost = True
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_exception(ConnectionError(f"bad response: {exc}"))
            assert self.transport is not None
            self.transport.close()

    # -- httptools -------------------------------------------------------------------------

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.head is not None and not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.status != 200 and len(self.answer) < ANSWER_BYTES:
            self.answer += body[:ANSWER_BYTES]
        buf = self.tail + body if self.tail else body
        now, end, found = self.now, 0, 0
        lat = self.stats.chunk_lat
        for match in STAMP.finditer(buf):
            lat.append(now - int(match.group(1)))
            end = match.end()
            found += 1
        if found:
            if BURN_NS[0]:  # a streaming client's own work per chunk (--client-us)
                until = time.perf_counter_ns() + BURN_NS[0] * found
                while time.perf_counter_ns() < until:
                    pass
            if not self.stamps:
                self.first = now
            self.stamps += found
            stats = self.stats
            if stats.win_start <= now < stats.win_end:
                stats.win_chunks += found
        self.tail = buf[max(end, len(buf) - 40) :]

    def on_message_complete(self) -> None:
        self.done_at = self.now
        self.keep = self.parser.should_keep_alive()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    # -- use -------------------------------------------------------------------------------

    async def request(self, data: bytes, stats: Stats) -> int:
        """Send one request and wait for its whole response; returns when it was sent (ns)."""
        if self.lost:
            raise ConnectionError("connection closed")
        loop = asyncio.get_running_loop()
        self.stats, self.status, self.stamps, self.first, self.tail = stats, 0, 0, 0, b""
        self.answer = b""
        self.waiter = loop.create_future()
        self.head = loop.create_future()
        sent = time.time_ns()
        assert self.transport is not None
        self.transport.write(data)
        await self.waiter
        return sent

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def status_line(self) -> str:
        """`status N`, and the start of its body when it is no 200 (an error reason)."""
        said = self.answer[:ANSWER_BYTES].decode("utf-8", "replace")
        return f"status {self.status}" + (f": {said}" if said else "")


async def connect(port: int) -> Conn:
    _, conn = await asyncio.get_running_loop().create_connection(Conn, "127.0.0.1", port)
    return conn


def build_request(
    port: int,
    *,
    stream: bool,
    tokens: int,
    path: str = "/v1/chat/completions",
    step_ms: float | None = None,
    ttft: float | None = None,
    tps: float | None = None,
    headers: dict[str, str] | None = None,
) -> bytes:
    body = orjson.dumps(
        {
            "model": "sim-model",
            "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "stream": stream,
        }
    )
    lines = [
        b"POST %s HTTP/1.1" % path.encode(),
        b"host: 127.0.0.1:%d" % port,
        b"content-type: application/json",
        b"content-length: %d" % len(body),
        b"x-sim-output-tokens: %d" % tokens,
    ]
    if step_ms is not None:
        lines.append(b"x-bench-step-ms: " + repr(float(step_ms)).encode())
    if ttft is not None:
        lines.append(b"x-sim-ttft: " + repr(float(ttft)).encode())
    if tps is not None:
        lines.append(b"x-sim-tps: " + repr(float(tps)).encode())
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}".encode("latin-1"))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def summary(values: list[int]) -> dict[str, float] | None:
    """Percentiles in microseconds of values in nanoseconds (proxy.bench.stats.quantile)."""
    if not values:
        return None
    ordered = sorted(values)

    def at(q: float) -> float:
        return (quantile(ordered, q) or 0) / 1000

    return {
        "n": len(ordered),
        "p50": at(50),
        "p90": at(90),
        "p99": at(99),
        "p999": at(99.9),
        "max": ordered[-1] / 1000,
        "mean": sum(ordered) / len(ordered) / 1000,
    }


# -- phases --------------------------------------------------------------------------------


async def run_stream(cmd: dict[str, Any]) -> dict[str, Any]:
    """`streams` connections stream back to back until `duration`; in-flight ones finish."""
    port, streams, tokens = cmd["port"], cmd["streams"], cmd["tokens"]
    step_ms, duration = cmd.get("step_ms"), cmd["duration"]
    data = build_request(
        port,
        stream=True,
        tokens=tokens,
        path=cmd.get("path", "/v1/chat/completions"),
        step_ms=step_ms,
        ttft=cmd.get("ttft"),
        tps=cmd.get("tps"),
        headers=cmd.get("headers"),
    )
    BURN_NS[0] = int(cmd.get("client_us", 0.0) * 1000)
    start = time.time_ns()
    warm = cmd.get("warm", 0.0)
    stats = Stats(start + int(warm * 1e9), start + int(duration * 1e9))
    deadline = time.monotonic() + duration

    async def worker() -> None:
        conn: Conn | None = None
        try:
            while time.monotonic() < deadline:
                if conn is None or conn.lost or not conn.keep:
                    if conn is not None:
                        conn.close()
                    try:
                        conn = await connect(port)
                    except OSError:
                        stats.errors += 1
                        await asyncio.sleep(0.01)
                        continue
                try:
                    sent = await conn.request(data, stats)
                except ConnectionError as exc:
                    stats.requests += 1
                    stats.failed(f"{exc} after {conn.stamps} chunks")
                    stats.expected += tokens
                    stats.chunks += conn.stamps
                    continue
                stats.requests += 1
                stats.expected += tokens
                stats.chunks += conn.stamps
                if conn.first:
                    stats.ttft.append(conn.first - sent)
                if conn.status == 200 and conn.stamps == tokens:
                    stats.ok += 1
                else:
                    stats.failed(f"{conn.status_line()}, {conn.stamps}/{tokens} chunks")
        finally:
            if conn is not None:
                conn.close()

    budget = duration + tokens * (step_ms or 20) / 1000 * 3 + 30
    tasks = [asyncio.ensure_future(worker()) for _ in range(streams)]
    _, pending = await asyncio.wait(tasks, timeout=budget)
    for task in pending:
        task.cancel()
    end = time.time_ns()
    window = (min(stats.win_end, end) - stats.win_start) / 1e9
    return {
        "requests": stats.requests,
        "ok": stats.ok,
        "errors": stats.errors + len(pending),
        "timed_out": bool(pending),
        "chunks": stats.chunks,
        "expected_chunks": stats.expected,
        "wall_s": (end - start) / 1e9,
        "window_s": window,
        "delivered_per_s": stats.win_chunks / window if window > 0 else 0.0,
        "offered_per_s": streams / (step_ms / 1000) if step_ms else None,
        "chunk_latency_us": summary(stats.chunk_lat),
        # stalled: chunks that reached the client more than one decode step after the
        # backend wrote them (the stream missed a step at the client)
        "stalled_chunks": sum(x > step_ms * 1e6 for x in stats.chunk_lat) if step_ms else None,
        "ttft_us": summary(stats.ttft),
        "error_reasons": stats.why,
        **({"chunk_latency_ns": stats.chunk_lat} if cmd.get("raw") else {}),
    }


async def run_poisson(cmd: dict[str, Any]) -> dict[str, Any]:
    """Open loop: arrivals at exponential gaps; latency counts from the planned arrival."""
    port, rate, duration = cmd["port"], cmd["rate"], cmd["duration"]
    data = build_request(
        port,
        stream=False,
        tokens=cmd.get("tokens", 1),
        ttft=0.0,
        path=cmd.get("path", "/v1/chat/completions"),
        headers=cmd.get("headers"),
    )
    rng = random.Random(cmd.get("seed", 1))
    stats = Stats()
    idle: list[Conn] = []
    opened = 0

    async def one(planned: int) -> None:
        nonlocal opened
        conn = None
        while idle and conn is None:
            conn = idle.pop()
            if conn.lost:
                conn = None
        try:
            if conn is None:
                if opened >= MAX_CONNECTIONS:
                    stats.errors += 1
                    return
                opened += 1
                conn = await connect(port)
            await conn.request(data, stats)
        except (ConnectionError, OSError) as exc:
            stats.failed(f"{type(exc).__name__}: {exc}")
            if conn is not None:
                conn.close()
            return
        stats.requests += 1
        stats.latency.append(conn.done_at - planned)
        if conn.status == 200:
            stats.ok += 1
        else:
            stats.failed(conn.status_line())
        if conn.keep and not conn.lost:
            idle.append(conn)
        else:
            conn.close()

    tasks: list[asyncio.Future[None]] = []
    start = time.time_ns()
    end = start + int(duration * 1e9)
    planned = start
    while True:
        planned += int(rng.expovariate(rate) * 1e9)
        if planned >= end:
            break
        ahead = planned - time.time_ns()
        if ahead > 500_000:  # uvloop's timers tick in ms: wake early, then send on time
            await asyncio.sleep((ahead - 500_000) / 1e9)
        tasks.append(asyncio.ensure_future(one(planned)))
    offered = len(tasks)
    _, pending = await asyncio.wait(tasks, timeout=duration + 30) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    wall = (time.time_ns() - start) / 1e9
    for conn in idle:
        conn.close()
    return {
        "offered": offered,
        "requests": stats.requests,
        "ok": stats.ok,
        "errors": stats.errors + len(pending),
        "connections": opened,
        "wall_s": wall,
        "achieved_per_s": stats.ok / duration,
        "latency_us": summary(stats.latency),
        "error_reasons": stats.why,
    }


async def run_hold(cmd: dict[str, Any], out: Any) -> dict[str, Any]:
    """Open `streams` streams that stay open `hold` s; say `open` once every one has headers."""
    port, n, hold = cmd["port"], cmd["streams"], cmd["hold"]
    data = build_request(
        port,
        stream=True,
        tokens=1,
        ttft=hold,
        path=cmd.get("path", "/v1/chat/completions"),
        headers=cmd.get("headers"),
    )
    stats = Stats()
    gate = asyncio.Semaphore(64)  # don't flood the listen backlog with SYNs

    async def opened() -> Conn:
        async with gate:
            return await connect(port)

    conns = await asyncio.gather(*(opened() for _ in range(n)), return_exceptions=True)
    live = [c for c in conns if isinstance(c, Conn)]
    requests = [asyncio.ensure_future(c.request(data, stats)) for c in live]
    await asyncio.sleep(0)
    heads = [c.head for c in live if c.head is not None]
    _, waiting = await asyncio.wait(heads, timeout=hold * 0.8)
    out({"event": "open", "streams": len(heads) - len(waiting)})
    await asyncio.wait(requests, timeout=hold + 30)
    ok = sum(1 for c in live if c.status == 200 and c.stamps == 1)
    for conn in live:
        conn.close()
    return {"streams": n, "connected": len(live), "ok": ok, "errors": n - ok}


_BACKGROUND: set[asyncio.Task[None]] = set()  # the in-process simulator, kept referenced


async def serve(sim_port: int | None = None, otlp_port: int | None = None) -> None:
    """Read commands from stdin; with `sim_port`, also serve the simulator in this loop."""
    loop = asyncio.get_running_loop()
    if sim_port is not None:
        from peers import sim_server

        _BACKGROUND.add(loop.create_task(sim_server.serve(sim_port, otlp_port)))
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    def out(obj: dict[str, Any]) -> None:
        sys.stdout.write(orjson.dumps(obj).decode() + "\n")
        sys.stdout.flush()

    out({"event": "ready"})
    while line := await reader.readline():
        cmd = orjson.loads(line)
        op = cmd["op"]
        if op == "quit":
            break
        try:
            if op == "stream":
                result = await run_stream(cmd)
            elif op == "poisson":
                result = await run_poisson(cmd)
            elif op == "hold":
                result = await run_hold(cmd, out)
            else:
                result = {"error": f"unknown op {op!r}"}
        except Exception as exc:  # report, don't die: the orchestrator decides
            result = {"error": f"{type(exc).__name__}: {exc}"}
        out({"event": "result", **result})


def main() -> None:
    """`--sim-port P [--otlp-port Q]`: the one-process load shape (emitter and client together)."""
    import argparse

    import uvloop

    parser = argparse.ArgumentParser()
    parser.add_argument("--sim-port", type=int, default=None)
    parser.add_argument("--otlp-port", type=int, default=None)
    args = parser.parse_args()
    uvloop.run(serve(args.sim_port, args.otlp_port))


if __name__ == "__main__":
    main()
