"""Where a measured request's own CPU goes, part by part, in one process without sockets.

`perchunk.py` times what runs for each relayed chunk; this times what runs once per
request around them, with the sinks `tokenprobe serve` builds for the benchmark's
`tokenprobe-log` arm (Prometheus metrics, conversations, the JSON access log, here
written to /dev/null). A streamed vLLM-shaped chat answer of CHUNKS content events plus
its finish and usage events is measured as the wire measures it: `begin` (the
exchange and its observer, the in-flight gauge, the conversation turn), the head,
each chunk's `feed` and the usage stripper (the client did not ask for usage, the proxy
did), the end of the stream, and `finish` (the record, then each sink).
Each part is timed inside every request, and the repeat that took least is reported, in
µs per request; divide by the chunks per request for the share of a chunk (the emitter
shape relays 40 a request).

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
from typing import TYPE_CHECKING, Any

from harness import checkout  # noqa: F401  (this checkout's proxy/ first)

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

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


def parts(chunks: int) -> tuple[Callable[[list[float]], None], CollectorRegistry]:
    """One timed request, and the registry its records are counted in."""
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

    def request(spent: list[float]) -> None:
        """One measured request; adds each part's seconds to `spent`."""
        t0 = time.perf_counter()
        exchange = begin()
        t1 = time.perf_counter()
        stream(exchange)
        t2 = time.perf_counter()
        run_soon(exchange.finish(t2, None), now=True)
        t3 = time.perf_counter()
        spent[0] += t1 - t0
        spent[1] += t2 - t1
        spent[2] += t3 - t2

    return request, app.registry


def counted(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The sum of a counter's samples with these labels: what the records added up to."""
    return sum(
        sample.value
        for metric in registry.collect()
        for sample in metric.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def best(request: Callable[[list[float]], None], n: int) -> list[float]:
    """µs per request of each part, in the repeat of `n` requests that took least."""
    runs = []
    for _ in range(REPEATS):
        spent = [0.0, 0.0, 0.0]
        for _ in range(n):
            request(spent)
        runs.append(spent)
    return [part / n * 1e6 for part in min(runs, key=sum)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=40, help="content events per request")
    parser.add_argument("--requests", type=int, default=N, help="requests per repeat")
    args = parser.parse_args()
    from proxy import build

    asyncio.set_event_loop(asyncio.new_event_loop())  # the conversation sweep's timer
    request, registry = parts(args.chunks)
    sys.stdout.flush()
    terminal = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    try:
        begin, streamed, finish = best(request, args.requests)
    finally:
        sys.stdout.flush()
        os.dup2(terminal, 1)
    whole = begin + streamed + finish
    print(f"build: {build.describe()}; {args.chunks} content events a request")
    print(f"  begin (exchange, observer, gauge, turn)  {begin:7.1f} µs")
    print(f"  head + {args.chunks + 4} events stripped, fed; end  {streamed:7.1f} µs")
    print(f"  finish (record + sinks)                  {finish:7.1f} µs")
    print(f"  whole request                            {whole:7.1f} µs"
          f"  = {whole / args.chunks:.1f} µs a content chunk")  # fmt: skip
    # Every timed request ends with its record: each must be one measured request.
    requests = counted(registry, "tokenprobe_requests_total", finish_reason="stop")
    tokens = counted(registry, "tokenprobe_generation_tokens_total", source="usage")
    print(f"recorded: {requests:.0f} requests (finish stop), {tokens:.0f} output tokens (usage)")


if __name__ == "__main__":
    main()
