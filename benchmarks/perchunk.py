"""Where a relayed chunk's CPU goes, part by part, measured in one process without sockets.

Each part runs in a tight loop on uvloop over a vLLM-shaped chat chunk (about 230 bytes,
one SSE event): the best of several repeats, in µs per chunk. The parts are those of
tokenprobe's relay (proxy/server/forward.py on the aiohttp transport) and of the
protocol-level relay prototype (since retired for the wire); the syscalls (one read, one write: about 20 µs a
chunk on this VM, the byte relay's whole cost) are not here, `relay.py` measures them.

  aiohttp read     aiohttp's C response parser and StreamReader: feed one framed chunk,
                   `await readany()` it (data already there: no suspension)
  task wakeup      a task suspended on a future that a callback resolves: what each
                   `await read()` costs when the chunk is not there yet (the usual case)
  asgi send        uvicorn's RequestResponseCycle.send of one body message: the message
                   dict, the checks, chunked framing and transport.write (a no-op here)
  observer         StreamObserver.feed: SSE split, orjson parse, a few lookups
  stripper         UsageEventStripper.feed on a chunk without usage
  httptools parse  llhttp (httptools) framing one chunk, with its on_body callback
  chunk framing    b"%x\\r\\n%b\\r\\n" % (len, body): what the wire adds per chunk

    .venv/bin/python benchmarks/perchunk.py
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httptools
from harness import checkout  # noqa: F401  (this checkout's proxy/ first)

from proxy.core.observe import StreamObserver
from proxy.core.request import parse_request
from proxy.core.strip import UsageEventStripper

EVENT = (
    b'data: {"id":"chatcmpl-0b3c6e1f2a4d4c7e9f1a2b3c4d5e6f70","object":"chat.completion.chunk",'
    b'"created":1764547200,"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,'
    b'"delta":{"content":" sea"},"logprobs":null,"finish_reason":null}]}\n\n'
)
FRAMED = b"%x\r\n%b\r\n" % (len(EVENT), EVENT)
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
N = 20_000
REPEATS = 5


def best(fn: Callable[[int], None]) -> float:
    """µs per call of the best of REPEATS runs of fn(N)."""
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn(N)
        times.append(time.perf_counter() - t0)
    return min(times) / N * 1e6


async def abest(fn: Callable[[int], Awaitable[None]]) -> float:
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        await fn(N)
        times.append(time.perf_counter() - t0)
    return min(times) / N * 1e6


def observer(n: int) -> None:
    info, _ = parse_request("/v1/chat/completions", b'{"model":"m","stream":true}')
    obs = StreamObserver(info, 0.0)
    obs.open(200, "text/event-stream", 0.0)
    feed = obs.feed
    for i in range(n):
        feed(EVENT, float(i))


def stripper(n: int) -> None:
    feed = UsageEventStripper().feed
    for _ in range(n):
        feed(EVENT)


def framing(n: int) -> None:
    body = EVENT
    for _ in range(n):
        b"%x\r\n%b\r\n" % (len(body), body)


class _Sink:
    def on_body(self, body: bytes) -> None:
        pass


def httptools_parse(n: int) -> None:
    parser = httptools.HttpResponseParser(_Sink())
    parser.feed_data(HEAD)
    feed = parser.feed_data
    for _ in range(n):
        feed(FRAMED)


class _Transport(asyncio.Transport):
    def write(self, data: Any) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


async def asgi_send(n: int) -> None:
    from uvicorn.protocols.http.flow_control import FlowControl
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    transport = _Transport()
    scope: Any = {"type": "http", "method": "POST", "http_version": "1.1", "headers": []}
    cycle = RequestResponseCycle(
        scope,
        transport,
        FlowControl(transport),
        logging.getLogger("bench"),
        logging.getLogger("bench.access"),
        False,
        [],
        asyncio.Event(),
        False,
        True,
        lambda: None,
    )
    await cycle.send({"type": "http.response.start", "status": 200, "headers": []})
    send = cycle.send
    for _ in range(n):
        await send({"type": "http.response.body", "body": EVENT, "more_body": True})


async def aiohttp_read(n: int) -> None:
    from aiohttp import StreamReader
    from aiohttp.base_protocol import BaseProtocol
    from aiohttp.http_parser import HttpResponseParser

    loop = asyncio.get_running_loop()
    protocol = BaseProtocol(loop)
    reader = StreamReader(protocol, 2**16, loop=loop)
    parser = HttpResponseParser(protocol, loop, 2**16, response_with_body=True)
    (message, payload), *_ = parser.feed_data(HEAD)[0]
    readany = payload.readany
    feed = parser.feed_data
    del reader, message
    for _ in range(n):
        feed(FRAMED)
        await readany()


async def task_wakeup(n: int) -> None:
    """Per chunk: a callback resolves a future; the task awaiting it resumes."""
    loop = asyncio.get_running_loop()
    for _ in range(n):
        fut = loop.create_future()
        loop.call_soon(fut.set_result, None)
        await fut


async def plain_callback(n: int) -> None:
    """Per chunk: one loop callback (what a protocol's data_received is), for comparison."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    left = [n]

    def tick() -> None:
        left[0] -= 1
        if left[0]:
            loop.call_soon(tick)
        else:
            done.set_result(None)

    loop.call_soon(tick)
    await done


async def measure() -> dict[str, float]:
    return {
        "aiohttp read": await abest(aiohttp_read),
        "task wakeup": await abest(task_wakeup),
        "loop callback": await abest(plain_callback),
        "asgi send": await abest(asgi_send),
        "observer": best(observer),
        "stripper": best(stripper),
        "httptools parse": best(httptools_parse),
        "chunk framing": best(framing),
    }


def work_per_chunk(fn: Callable[[int], None], n: int = 200) -> tuple[float, float]:
    """(Python bytecodes run, memory blocks allocated) per call of `fn`'s loop body, after
    a warm-up: what a chunk touches, which under many streams costs more than its µs alone
    (every chunk of another stream evicts this one's state from the caches)."""
    import gc
    import sys

    fn(n)  # warm-up: first-chunk work (identity, the template) is not per-chunk
    ops = 0

    def trace(frame: Any, event: str, arg: Any) -> Any:
        nonlocal ops
        frame.f_trace_opcodes = True
        if event == "opcode":
            ops += 1
        return trace

    sys.settrace(trace)
    try:
        fn(n)
    finally:
        sys.settrace(None)
    gc.disable()
    try:
        before = sys.getallocatedblocks()
        fn(n)
        blocks = sys.getallocatedblocks() - before
    finally:
        gc.enable()
    return ops / n, blocks / n


def main() -> None:
    import uvloop

    figures = uvloop.run(measure())
    print(f"vLLM-shaped event of {len(EVENT)} bytes; best of {REPEATS} x {N:,} (µs per chunk)")
    for name, us in figures.items():
        print(f"  {name:<16} {us:6.2f}")
    print("bytecodes / memory blocks kept per chunk (after a warm-up chunk):")
    for name, fn in (("observer", observer), ("stripper", stripper)):
        ops, blocks = work_per_chunk(fn)
        print(f"  {name:<16} {ops:6.0f} / {blocks:.2f}")


if __name__ == "__main__":
    main()
