"""One non-streaming request's CPU on the wire, in one process: A/B of per-request work.

`perrequest.py` times the measuring alone, without sockets; `ab.py` runs two trees as
servers under the load generator, where a few µs a request are lost in the noise of a
shared machine. This runs tokenprobe's wire (uvicorn with `WireProtocol`, the sinks
`serve` builds, the JSON access log to /dev/null) with a fixed-answer backend and one
keep-alive client in the same uvloop loop, over loopback sockets, and reports process CPU
per request (client and backend included: a constant of both trees). Each tree runs in
its own process, alternated, and the least of its runs is its figure.

    .venv/bin/python benchmarks/wirerequest.py                     # this checkout
    .venv/bin/python benchmarks/wirerequest.py /tmp/before .       # A/B, trees alternated
    .venv/bin/python benchmarks/wirerequest.py --path /bench/unmeasured   # nothing measured
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

ANSWER = (
    b'{"id":"chatcmpl-0b6f3d9e8a7c4b21","object":"chat.completion","created":1718000000,'
    b'"model":"sim-model","choices":[{"index":0,"message":{"role":"assistant",'
    b'"reasoning_content":null,"content":"Hello! How can I help you today?","tool_calls":[]},'
    b'"logprobs":null,"finish_reason":"length","stop_reason":null}],"usage":{'
    b'"prompt_tokens":12,"total_tokens":28,"completion_tokens":16,"prompt_tokens_details":null}}'
)
RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
    b"date: Mon, 01 Jan 2026 00:00:00 GMT\r\nserver: uvicorn\r\n\r\n%b" % (len(ANSWER), ANSWER)
)
BODY = (
    b'{"model":"sim-model","messages":[{"role":"user","content":"Tell me about the sea."}],'
    b'"stream":false}'
)


def _framed(buf: bytes) -> int:
    """The length of the first whole message (head + Content-Length body) in `buf`, or 0."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return 0
    head = buf[:end].lower()
    at = head.find(b"content-length: ")
    size = int(head[at + 16 :].split(b"\r\n")[0]) if at >= 0 else 0
    return end + 4 + size if len(buf) >= end + 4 + size else 0


class Backend(asyncio.Protocol):
    """Answers every request with RESPONSE."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while size := _framed(self.buf):
            self.buf = self.buf[size:]
            self.transport.write(RESPONSE)


class Client(asyncio.Protocol):
    """Sends `request` again as each answer ends, until `left` is spent."""

    def __init__(self, request: bytes, left: list[int], done: asyncio.Future[None]) -> None:
        self.request, self.left, self.done, self.buf = request, left, done, b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport

    def go(self) -> None:
        if self.left[0] <= 0:
            if not self.done.done():
                self.done.set_result(None)
            return
        self.left[0] -= 1
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        size = _framed(self.buf)
        if not size:
            return
        if not self.buf.startswith(b"HTTP/1.1 200"):
            raise SystemExit(f"unexpected answer: {self.buf[:200]!r}")
        self.buf = self.buf[size:]
        self.go()


async def serve(path: str, requests: int, repeats: int) -> tuple[list[float], str]:
    """µs of process CPU per request, one figure per repeat of `requests` requests, and
    what the proxy's metrics counted of them."""
    import uvicorn

    from proxy.server.assemble import assemble
    from proxy.server.serve import PROTOCOLS
    from proxy.settings import parse

    loop = asyncio.get_running_loop()
    backend = await loop.create_server(Backend, "127.0.0.1", 0)
    upstream = f"http://127.0.0.1:{backend.sockets[0].getsockname()[1]}"
    app = assemble(parse(["--upstream", upstream, "--access-log", "json"], {}), {})
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        log_level="warning",
        access_log=False,
        server_header=False,
        date_header=False,
        http=PROTOCOLS["wire"],
        lifespan="on",
    )
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    await server.startup()
    port = server.servers[0].sockets[0].getsockname()[1]
    request = (
        b"POST %b HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nuser-agent: bench\r\naccept: */*\r\n\r\n%b"
        % (path.encode(), port, len(BODY), BODY)
    )

    async def run(n: int) -> float:
        left, done = [n], loop.create_future()
        _, client = await loop.create_connection(
            lambda: Client(request, left, done), "127.0.0.1", port
        )
        start = time.process_time()
        client.go()
        await done
        spent = time.process_time() - start
        client.transport.close()
        return spent / n * 1e6

    await run(requests)  # warm up: imports, the pool's connection, the caches
    figures = [await run(requests) for _ in range(repeats)]
    server.should_exit = True
    counts = {
        name: sum(
            sample.value
            for metric in app.registry.collect()
            for sample in metric.samples
            if sample.name == f"tokenprobe_{name}_total"
        )
        for name in ("requests", "passthrough_requests")
    }
    return figures, ", ".join(f"{v:.0f} {k}" for k, v in counts.items())


def one(args: argparse.Namespace) -> None:
    import uvloop

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the access log
    figures, counted = uvloop.run(serve(args.path, args.requests, args.repeats))
    print("figures:", " ".join(f"{f:.1f}" for f in figures), file=sys.stderr)
    print("counted:", counted, file=sys.stderr, flush=True)
    os._exit(0)  # the server's lifespan and connections need no orderly end here


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trees", nargs="*", type=Path, help="source trees with proxy/ (default: .)")
    p.add_argument("--path", default="/v1/chat/completions")
    p.add_argument("--requests", type=int, default=3000, help="requests per repeat")
    p.add_argument("--repeats", type=int, default=3, help="repeats per process")
    p.add_argument("--rounds", type=int, default=4, help="processes per tree, alternated")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        one(args)
        return
    trees = [t.resolve() for t in args.trees or [ROOT]]
    figures: dict[Path, list[float]] = {t: [] for t in trees}
    counted: re.Match[str] | None = None
    for r in range(args.rounds):
        for tree in trees if r % 2 == 0 else trees[::-1]:
            sizes = ["--requests", str(args.requests), "--repeats", str(args.repeats)]
            out = subprocess.run(
                [sys.executable, __file__, "--one", "--path", args.path, *sizes],
                env={**os.environ, "PYTHONPATH": str(tree)},
                capture_output=True,
                text=True,
                cwd=tree,
            ).stderr
            found = re.search(r"figures: ([\d. ]+)", out)
            if found is None:
                raise SystemExit(f"{tree}: no figures\n{out}")
            figures[tree] += [float(f) for f in found.group(1).split()]
            counted = re.search(r"counted: (.*)", out)
    print(f"CPU µs per request, {args.path}, least of {args.rounds * args.repeats} runs:")
    if counted is not None:  # a measured path is counted as measured requests, or it is not
        print(f"  the last process's metrics counted: {counted.group(1)}")
    first = min(figures[trees[0]])
    for tree in trees:
        best = min(figures[tree])
        change = "" if tree == trees[0] else f"  ({best - first:+.1f} µs)"
        print(f"  {best:7.1f}  {tree}{change}")


if __name__ == "__main__":
    main()
