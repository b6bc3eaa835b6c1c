"""Socket-level parts for the edge tests: a backend that records the raw request it got,
and a real `tokenprobe serve` process in front of it.

The backend is a plain asyncio server (no HTTP library that could normalise what it
saw): it keeps the request line and header block byte for byte, and answers with
whatever raw bytes the test scripted, so a test can also play a broken upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import IO

from tests.scrape import scrape
from tests.servers import free_port, spawn, started, stop, wait_http

SSE_USAGE_STREAM = (
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"role":"assistant","content":""}}]}\n\n'
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"content":"Hello"},"finish_reason":null}]}\n\n'
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{},"finish_reason":"stop"}]}\n\n'
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}\n\n'
    b"data: [DONE]\n\n"
)


def sse_response(
    body: bytes = SSE_USAGE_STREAM, content_type: bytes = b"text/event-stream"
) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: " + content_type + b"\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


Responder = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass
class Seen:
    head: bytes  # request line and headers, as received
    body: bytes

    @property
    def request_line(self) -> bytes:
        return self.head.split(b"\r\n", 1)[0]

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        lines = self.head.split(b"\r\n")[1:]
        out = []
        for line in lines:
            if line:
                name, _, value = line.partition(b":")
                out.append((name.lower(), value.strip(b" \t")))
        return out

    def header(self, name: bytes) -> list[bytes]:
        return [v for k, v in self.headers if k == name]


@dataclass
class RawBackend:
    """Answers each request with `response` (raw bytes), or runs `responder` instead."""

    response: bytes = field(default_factory=sse_response)
    responder: Responder | None = None
    seen: list[Seen] = field(default_factory=list)
    port: int = 0

    def __post_init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0, limit=2**20)
        )
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()

    def start(self) -> RawBackend:
        self._thread.start()
        self._ready.wait(5)
        return self

    def stop(self) -> None:
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.loop.stop()

        asyncio.run_coroutine_threadsafe(cancel_all(), self.loop)
        self._thread.join(5)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                seen = Seen(head[:-2], b"")
                length = next((int(v) for k, v in seen.headers if k == b"content-length"), 0)
                seen.body = await reader.readexactly(length)
                self.seen.append(seen)
                if self.responder is not None:
                    await self.responder(reader, writer)
                    return
                writer.write(self.response)
                await writer.drain()
        writer.close()


@contextlib.contextmanager
def serving(upstream: str, *flags: str) -> Iterator[str]:
    """A real `tokenprobe serve` process in front of `upstream`; yields its base URL."""
    with serving_process(upstream, *flags) as (base, _):
        yield base


@contextlib.contextmanager
def serving_process(
    upstream: str,
    *flags: str,
    stderr: int | IO[bytes] = subprocess.PIPE,
    stdout: int | None = None,  # a file descriptor; None: nowhere
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A `tokenprobe serve` in front of `upstream`, `flags` after the defaults (a flag given
    again wins: `--access-log json` with `stdout` a file for its records)."""
    port = free_port()
    process = spawn(
        "serve",
        "--upstream",
        upstream,
        "--port",
        str(port),
        "--access-log",
        "off",
        "--models-refresh",
        "0",
        "--model-allowlist",
        "m",
        *flags,
        stderr=stderr,
        stdout=subprocess.DEVNULL if stdout is None else stdout,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/healthz")
        yield base, process
    finally:
        stop(process)
        if process.stderr is not None:
            process.stderr.close()


def backend(**kwargs: object) -> contextlib.AbstractContextManager[RawBackend]:
    return started(RawBackend(**kwargs))  # type: ignore[arg-type]


def metric(base: str, name: str, **labels: str) -> float:
    """A sample of the proxy's /metrics, summed over the series whose labels include
    `labels` (0 when it has none)."""
    return scrape(base, timeout=5).total(name, **labels)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")
