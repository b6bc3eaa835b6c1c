"""Hostile peers for the proxy: a raw client that writes exact bytes, and a raw upstream
that records every byte each connection sent it and misbehaves on command.

Neither uses an HTTP library that could normalise what it writes or saw. The upstream
runs a *script* per connection: a coroutine that reads requests and writes whatever raw
bytes the test wants (two responses in one write, a partial message, a response while
the connection sits idle, an early 101, CL and TE together...). Everything a connection
received is kept, in order, in `RawUpstream.received[i]`, so a test can say exactly which
bytes reached the upstream, and `requests` lists the parsed request heads in arrival order.

`byte_relay` is a plain TCP pipe in front of the upstream. It is the "before" that the
suite is shown able to fail against: a test of a defence run through `byte_relay`
instead of the proxy must fail (see `test_kit.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from tests.servers import started

__all__ = [
    "SSE_BODY",
    "Conn",
    "RawUpstream",
    "Script",
    "answer_each",
    "by_target",
    "byte_relay",
    "exchange",
    "keeping",
    "ok",
    "raw_upstream",
    "read_response",
]


def ok(
    body: bytes = b'{"ok":true}', *, extra_headers: bytes = b"", status: bytes = b"200 OK"
) -> bytes:
    """A complete HTTP/1.1 response with a Content-Length."""
    return (
        b"HTTP/1.1 "
        + status
        + b"\r\ncontent-type: application/json\r\n"
        + extra_headers
        + b"content-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


SSE_BODY = (
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"role":"assistant","content":""}}]}\n\n'
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"content":"Hello"},"finish_reason":null}]}\n\n'
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{},"finish_reason":"stop"}]}\n\n'
    b"data: [DONE]\n\n"
)


def get(target: bytes) -> bytes:
    """A GET request for `target`, as a client writes it."""
    return b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n"


@dataclass
class Request:
    """One request head (request line and headers, CRLFs as received) and its body."""

    head: bytes
    body: bytes

    @property
    def line(self) -> bytes:
        return self.head.split(b"\r\n", 1)[0]

    @property
    def target(self) -> bytes:
        return self.line.split(b" ")[1]

    def header(self, name: bytes) -> list[bytes]:
        out = []
        for raw in self.head.split(b"\r\n")[1:]:
            key, _, value = raw.partition(b":")
            if key.strip().lower() == name.lower():
                out.append(value.strip())
        return out


@dataclass
class Conn:
    """One upstream connection, as its script sees it."""

    index: int  # 0 for the upstream's first accepted connection, then 1, 2, ...
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    upstream: RawUpstream

    async def read_request(self, timeout: float = 10.0) -> Request | None:
        """The next request head and its Content-Length body (chunked bodies are read to
        their last chunk, raw); None when the peer closed first."""
        try:
            head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), timeout)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            return None
        request = Request(head[:-4], b"")
        length = request.header(b"content-length")
        if length:
            request.body = await self.reader.readexactly(int(length[0]))
        elif b"chunked" in b",".join(request.header(b"transfer-encoding")).lower():
            body = bytearray()
            while not body.endswith(b"\r\n0\r\n\r\n") and not body.startswith(b"0\r\n\r\n"):
                body += await self.reader.readuntil(b"\r\n")
            request.body = bytes(body)
        self.upstream.requests.append(request)
        return request

    def write(self, data: bytes) -> None:
        self.writer.write(data)

    async def drain(self) -> None:
        await self.writer.drain()

    async def wait_closed_by_peer(self, timeout: float = 10.0) -> bool:
        """True when the proxy closed this connection within `timeout` (read EOF)."""
        try:
            while await asyncio.wait_for(self.reader.read(65536), timeout):
                pass
        except (TimeoutError, ConnectionError):
            return False
        return True


Script = Callable[[Conn], Awaitable[None]]


def answer_each(response: bytes = b"") -> Script:
    """The well-behaved upstream: each request on the connection gets `response`."""
    answer = response or ok()

    async def script(conn: Conn) -> None:
        while await conn.read_request() is not None:
            conn.write(answer)
            await conn.drain()

    return script


def keeping(answer: bytes, received: bytearray) -> Script:
    """An upstream that reads one request, answers `answer` (a 101, say), and keeps in
    `received` every byte the connection sends after it, to its end."""

    async def script(conn: Conn) -> None:
        await conn.read_request()
        conn.write(answer)
        await conn.drain()
        while chunk := await conn.reader.read(1 << 16):
            received.extend(chunk)

    return script


Handler = Callable[[Conn, Request], Awaitable[None]]


def by_target(handlers: dict[bytes, Handler], default: bytes = b"") -> Script:
    """Each request on the connection is answered by the handler for its target (path and
    query, as received), others with `default` (ok()). A handler writes what it likes,
    may sleep, and returns when the connection should read its next request."""
    answer = default or ok()

    async def script(conn: Conn) -> None:
        while (request := await conn.read_request()) is not None:
            handler = handlers.get(request.target)
            if handler is None:
                conn.write(answer)
                await conn.drain()
            else:
                await handler(conn, request)

    return script


class _Recorder(asyncio.StreamReaderProtocol):
    """Feeds the stream reader as usual and keeps a copy of every byte received; its
    transport is in `open` while the connection is."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        record: bytearray,
        cb: object,
        open_: set[asyncio.BaseTransport],
    ) -> None:
        super().__init__(reader, cb)  # type: ignore[arg-type]
        self._record = record
        self._open = open_

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._open.add(transport)
        self._transport_kept = transport
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._open.discard(self._transport_kept)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._record += data
        super().data_received(data)


@dataclass
class RawUpstream:
    """A raw HTTP/1.1 upstream on 127.0.0.1:<ephemeral>, in a thread with its own loop.

    `scripts[i]` runs on the i-th accepted connection; connections past the list run
    `default`. Set either before or while the test runs (it is read at accept time)."""

    default: Script = field(default_factory=answer_each)
    scripts: list[Script] = field(default_factory=list)
    received: list[bytearray] = field(default_factory=list)  # every byte, per connection
    requests: list[Request] = field(default_factory=list)  # every request head, in order
    port: int = 0

    def __post_init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._tasks: set[asyncio.Task[None]] = set()
        self._open: set[asyncio.BaseTransport] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def connections(self) -> int:
        return len(self.received)

    def all_received(self) -> bytes:
        return b"".join(bytes(r) for r in self.received)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]

        def factory() -> asyncio.Protocol:
            record = bytearray()
            self.received.append(record)
            index = len(self.received) - 1
            reader = asyncio.StreamReader(limit=2**22, loop=self.loop)

            def connected(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
                script = self.scripts[index] if index < len(self.scripts) else self.default
                task = self.loop.create_task(self._serve(script, Conn(index, r, w, self)))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

            return _Recorder(reader, record, connected, self._open)

        self._server = self.loop.run_until_complete(self.loop.create_server(factory, sock=sock))
        self._ready.set()
        self.loop.run_forever()

    async def _serve(self, script: Script, conn: Conn) -> None:
        with contextlib.suppress(Exception):
            await script(conn)
        with contextlib.suppress(Exception):
            conn.writer.close()

    def start(self) -> RawUpstream:
        self._thread.start()
        if not self._ready.wait(5):
            raise RuntimeError("the raw upstream did not start")
        return self

    def stop(self) -> None:
        async def cancel_all() -> None:
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self.loop.stop()

        asyncio.run_coroutine_threadsafe(cancel_all(), self.loop)
        self._thread.join(5)

    def hang_up(self) -> None:
        """Every script stopped and every connection reset, at once: a request the test
        left held ends now, and a proxy keeps none of these connections in its pool."""
        asyncio.run_coroutine_threadsafe(self._hang_up(), self.loop).result(5)

    def reset(self) -> None:
        """Hung up, and the test forgotten: its scripts and everything received; the
        next connection is 0 again. For a module's tests that share this upstream."""

        async def forget() -> None:
            await self._hang_up()
            self.default, self.scripts = answer_each(), []
            self.received, self.requests = [], []

        asyncio.run_coroutine_threadsafe(forget(), self.loop).result(5)

    async def _hang_up(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for transport in list(self._open):
            transport.abort()  # type: ignore[attr-defined]

    def wait_for(self, condition: Callable[[], bool], timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return True
            time.sleep(0.01)
        return condition()


def raw_upstream(**kwargs: object) -> contextlib.AbstractContextManager[RawUpstream]:
    return started(RawUpstream(**kwargs))  # type: ignore[arg-type]


# -- the client side ----------------------------------------------------------------------


#: How long an exchange whose answers are whole (`done`) still listens for more: what a
#: proxy writes with them or just after them (a read's bytes, relayed in one go) lands in
#: it. The `idle` wait it cuts short, on a connection kept alive, was 147 s of the 334 s
#: tests/hostile took serially.
QUIET = 0.25


def exchange(
    base: str,
    data: bytes,
    *,
    idle: float = 1.0,
    total: float = 10.0,
    then: bytes | None = None,
    after: float = 0.0,
    done: Callable[[bytes], bool] | None = None,
) -> bytes:
    """Open a connection to `base` (http://host:port), write `data` exactly, optionally
    write `then` after `after` seconds, and return every byte received until the proxy
    closes or stays silent for `idle` seconds after its first byte (or `total` passes:
    the wait for the first byte has only that limit, so a loaded box that is slow to
    answer at all is not taken for a proxy that answered nothing).

    `done` (tests/hostile/client.py's `whole`) says when the answers the test expects are
    all in (`then` sent): from then on `QUIET` seconds of silence end the exchange, and a
    byte after them brings back the `idle` wait. Until then only the close or `total`
    ends it, so a slow proxy's answer is read whole however long its pauses."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    got = bytearray()
    whole_at = -1  # how many bytes were in when `done` first held
    with socket.create_connection((host, int(port)), timeout=total) as sock:
        sock.sendall(data)
        deadline = time.monotonic() + total
        sent_then = then is None
        start = time.monotonic()
        while time.monotonic() < deadline:
            if not sent_then and time.monotonic() - start >= after:
                sock.sendall(then or b"")
                sent_then = True
            if sent_then and done is not None and whole_at < 0 and done(bytes(got)):
                whole_at = len(got)
            if not sent_then:
                sock.settimeout(max(0.01, after - (time.monotonic() - start)))
            elif whole_at == len(got):
                sock.settimeout(min(idle, QUIET))
            elif got and (done is None or whole_at >= 0):
                sock.settimeout(idle)
            else:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                if sent_then:
                    break
                continue
            except ConnectionError:
                break
            if not chunk:
                break
            got += chunk
    return bytes(got)


def read_response(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """One response (head + Content-Length body) from `sock`, raw; b'' on close."""
    sock.settimeout(timeout)
    buf = bytearray()
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            return bytes(buf)
        buf += chunk
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == b"content-length":
            length = int(value)
    body = bytearray(rest)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + bytes(body)


# -- the "before": a plain byte relay -----------------------------------------------------


@contextlib.contextmanager
def byte_relay(upstream: str) -> Iterator[str]:
    """A TCP pipe to `upstream` on 127.0.0.1:<ephemeral>: no parsing, no policy. Tests of
    the proxy's defences are shown able to fail by running them through this."""
    host, port = upstream.removeprefix("http://").rsplit(":", 1)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    bound: list[int] = []

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        with contextlib.suppress(Exception):
            dst.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def run() -> None:
        asyncio.set_event_loop(loop)
        server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
        bound.append(server.sockets[0].getsockname()[1])
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(5)
    try:
        yield f"http://127.0.0.1:{bound[0]}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
