"""Where a measured request's own CPU goes, part by part, in one process without sockets.

`perchunk.py` times what runs for each relayed chunk; this times what runs once per
request around them, with the sinks `tokenprobe serve` builds for the benchmark's
`tokenprobe-log` arm (Prometheus metrics, conversations, the JSON access log, here
written to /dev/null). A streamed vLLM-shaped chat answer of CHUNKS content events plus
its finish and usage events is measured as the wire measures it: `begin` (the
exchange and its observer, the in-flight gauge, the conversation turn), the head,
each chunk's `feed` and the usage stripper (the client did not ask for usage, the proxy
did), the end of the stream, and `finish` (the record, then each sink).
Best of several repeats, µs per request; divide by the chunks per request for the share
of a chunk (the emitter shape relays 40 a request).

    .venv/bin/python benchmarks/perrequest.py [--chunks 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import checkout  # noqa: F401  (this checkout's proxy/ first)

N = 2_000
REPEATS = 5


def chat_events(chunks: int) -> list[bytes]:
    def event(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        body = {"id": "chatcmpl-0b3c6e1f", "object": "chat.completion.chunk",
                "created": 1764547200, "model": "m", "choices": [choice]}  # fmt: skip
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    usage = {"id": "chatcmpl-0b3c6e1f", "object": "chat.completion.chunk", "created": 1,
             "model": "m", "choices": [],
             "usage": {"prompt_tokens": 12, "completion_tokens": chunks, "total_tokens": 12 + chunks}}  # fmt: skip
    return [
        event({"role": "assistant", "content": ""}),
        *(event({"content": f" t{i}"}) for i in range(chunks)),
        event({}, "stop"),
        b"data: " + json.dumps(usage, separators=(",", ":")).encode() + b"\n\n",
        b"data: [DONE]\n\n",
    ]


def parts(chunks: int) -> dict[str, Callable[[], None]]:
    from proxy.core.request import parse_request
    from proxy.core.strip import UsageEventStripper
    from proxy.server.admission import relay_settings
    from proxy.server.assemble import assemble
    from proxy.server.exchange import Context, MeasuredExchange, run_soon
    from proxy.settings import parse

    settings = parse(["--upstream", "http://127.0.0.1:9", "--access-log", "json"], {})
    app = assemble(settings, {})  # its access log writes to fd 1: /dev/null while timed
    context = Context(app.sinks, None, relay_settings(settings))
    path = "/v1/chat/completions"
    body = json.dumps(
        {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi there"}]}
    ).encode()
    events = chat_events(chunks)
    headers = [(b"host", b"x"), (b"content-type", b"application/json")]

    def begin() -> MeasuredExchange:
        info, _ = parse_request(path, body)
        now = time.perf_counter()
        return MeasuredExchange(context, path, headers, info, now, time.time(), now)

    def stream(exchange: MeasuredExchange) -> None:
        now = time.perf_counter()
        exchange.sent(now)
        exchange.open(200, "text/event-stream", now)
        exchange.relayed(now)
        feed, strip = exchange.feed, UsageEventStripper().feed  # the usage the proxy asked for
        for event in events:
            strip(event)
            feed(event, time.perf_counter())
        exchange.end_of_stream(time.perf_counter())

    def whole() -> None:
        exchange = begin()
        stream(exchange)
        run_soon(exchange.finish(time.perf_counter(), None), now=True)

    def begin_only() -> None:
        exchange = begin()
        context.sinks.end(exchange.request_scope, None)  # the in-flight gauge back down

    def begin_and_stream() -> None:
        exchange = begin()
        stream(exchange)
        context.sinks.end(exchange.request_scope, None)

    return {"begin": begin_only, "begin + stream": begin_and_stream, "whole request": whole}


def best(fn: Callable[[], None], n: int) -> float:
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append(time.perf_counter() - t0)
    return min(times) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=40, help="content events per request")
    parser.add_argument("--requests", type=int, default=N, help="requests per repeat")
    args = parser.parse_args()
    from proxy import build

    asyncio.set_event_loop(asyncio.new_event_loop())  # the conversation sweep's timer
    timed = parts(args.chunks)
    sys.stdout.flush()
    terminal = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    try:
        measured = {name: best(fn, args.requests) for name, fn in timed.items()}
    finally:
        sys.stdout.flush()
        os.dup2(terminal, 1)
    begin, streamed, whole = measured.values()
    print(f"build: {build.describe()}; {args.chunks} content events a request")
    print(f"  begin (exchange, observer, gauge, turn)  {begin:7.1f} µs")
    print(f"  head + {args.chunks + 4} events stripped, fed; end  {streamed - begin:7.1f} µs")
    print(f"  finish (record + sinks)                  {whole - streamed:7.1f} µs")
    print(f"  whole request                            {whole:7.1f} µs"
          f"  = {whole / args.chunks:.1f} µs a content chunk")  # fmt: skip


if __name__ == "__main__":
    main()
