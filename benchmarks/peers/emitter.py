"""A lean lockstep SSE backend for the multi-process benchmark; several may share one port.

Every process binds the port with SO_REUSEPORT, so the kernel spreads connections over
them. Each keeps a decode-step clock on the wall-clock grid (ticks at multiples of the
step since the epoch), so the processes tick together: every active stream of every
emitter gets one chunk per step, each chunk its own write, stamped with the time taken
just before the write. Chunks are shaped like vLLM's chat chunks (about 230 bytes) and,
as vLLM's, differ only in their text: the stamp is the text (`"content":"@<time_ns>"`),
the id is the stream's. (A stamp or id outside the text would make every chunk unlike
the one before, which no vLLM stream does, and defeat the observer's template match,
proxy/core/template.py: every chunk would be parsed as JSON.)

A request with `"stream":true` in its body streams `x-sim-output-tokens` content chunks
(step from `x-bench-step-ms`, else 1 / `x-sim-tps`, else 20 ms; the first after
`x-sim-ttft` s when given), a finish chunk and `data: [DONE]`; any other
request gets a small non-streaming completion at once. It is a load source, not a
simulator: `proxy/sim` is the backend with the behaviours tokenprobe must handle.

    python benchmarks/peers/emitter.py --port 9000     # run it N times for N emitters
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import socket
import time

import httptools

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
CHUNK = (
    b'data: {"id":"chatcmpl-bench-%d","object":"chat.completion.chunk",'
    b'"created":1764547200,"model":"sim-model","choices":[{"index":0,"delta":'
    b'{"content":"@%d"},"logprobs":null,"finish_reason":null}]}\n\n'
)
FINISH = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1764547200,'
    b'"model":"sim-model","choices":[{"index":0,"delta":{},"logprobs":null,'
    b'"finish_reason":"length"}]}\n\ndata: [DONE]\n\n'
)
STREAM_IDS = itertools.count(1)  # one id a stream, as vLLM's request id
COMPLETION = (
    b'{"id":"cmpl-bench","object":"chat.completion","created":1764547200,"model":"sim-model",'
    b'"choices":[{"index":0,"message":{"role":"assistant","content":"ok"},'
    b'"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
)


class Clock:
    """One process's decode steps: every stream registered for a step gets a chunk at it."""

    def __init__(self, step: float) -> None:
        self.step = step
        self.streams: set[Stream] = set()
        self.handle: asyncio.TimerHandle | None = None

    def add(self, stream: Stream) -> None:
        self.streams.add(stream)
        if self.handle is None:
            self._schedule()

    def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        now = time.time()
        due = (math.floor(now / self.step) + 1) * self.step  # next tick on the shared grid
        self.handle = loop.call_later(due - now, self._tick)

    def _tick(self) -> None:
        for stream in list(self.streams):
            if not stream.chunk():
                self.streams.discard(stream)
        self.handle = None
        if self.streams:
            self._schedule()


class Stream:
    __slots__ = ("conn", "id", "left")

    def __init__(self, conn: Conn, tokens: int) -> None:
        self.conn, self.left, self.id = conn, tokens, next(STREAM_IDS)

    def chunk(self) -> bool:
        """Write this step's chunk; False when the stream is over."""
        transport = self.conn.transport
        if transport.is_closing():
            return False
        data = CHUNK % (self.id, time.time_ns())
        transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        self.left -= 1
        if self.left > 0:
            return True
        transport.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(FINISH), FINISH))
        self.conn.idle()
        return False


class Conn(asyncio.Protocol):
    def __init__(self, clocks: dict[bytes, Clock]) -> None:
        self.clocks = clocks
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.parser = httptools.HttpRequestParser(self)
        self.body = b""
        self.tokens = 1
        self.step = b""
        self.tps = 0.0
        self.ttft = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_message_begin(self) -> None:
        self.body, self.tokens, self.step, self.tps, self.ttft = b"", 1, b"", 0.0, 0.0

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"x-sim-output-tokens":
            self.tokens = max(1, int(value))
        elif name == b"x-bench-step-ms":
            self.step = value
        elif name == b"x-sim-tps":
            self.tps = float(value)
        elif name == b"x-sim-ttft":
            self.ttft = float(value)

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        if b'"stream":true' not in self.body:
            self.transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                % (len(COMPLETION), COMPLETION)
            )
            return
        self.transport.pause_reading()  # one stream at a time on a connection
        self.transport.write(HEAD)
        step = self.step or (b"%g" % (1000 / self.tps) if self.tps > 0 else b"20")
        clock = self.clocks.get(step)
        if clock is None:
            clock = self.clocks[step] = Clock(float(step) / 1000)
        stream = Stream(self, self.tokens)
        if self.ttft > 0:  # the first token after ttft, then on the clock
            asyncio.get_running_loop().call_later(self.ttft, clock.add, stream)
        else:
            clock.add(stream)

    def idle(self) -> None:
        self.transport.resume_reading()


async def serve(port: int) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    clocks: dict[bytes, Clock] = {}
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Conn(clocks), sock=sock, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    import uvloop

    uvloop.run(serve(args.port))


if __name__ == "__main__":
    main()
