"""Every way a request can end, in-process, on both data paths: tokenprobe's uvicorn server
with the path's protocol in a thread (tests/conftest.py's start_proxy), a scripted upstream
on a raw asyncio socket server here, real sockets between them.

Each test asserts what the client got, what the upstream saw, and the record; with the
upstream keep-alive pool (a clean response's connection is reused, an abandoned or broken
one is closed) and backpressure (a client that does not read stops the proxy reading the
upstream). The drain's end (`drain_ends`: what uvicorn's shutdown does once
--drain-timeout runs out) runs on both paths. What only one path can run stays with that
path: the wire's own cut (Wire.close alone) is marked `paths("wire")` here, the ASGI relay's
httpx transport (`--upstream-transport`) `paths("asgi")`; what only the ASGI interface shows (one send per upstream read, the relay
freed at once, the drain cut as uvicorn cancels the request) is
tests/server/test_relay_inprocess.py.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, NoReturn

import httpx
import orjson
import pytest

from proxy.core.measurement import ErrorType, Measurement, TokenSource
from proxy.core.observe import StreamObserver
from proxy.sinks.sink import Labels
from tests.builds import replaces_observer_methods
from tests.conftest import ProxyUnderTest
from tests.paths import STREAMS
from tests.server.conftest import paths

MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # the model the recorded streams name
STREAM = (STREAMS / "vllm_chat.sse").read_bytes()
EVENTS = [part + b"\n\n" for part in STREAM.split(b"\n\n") if part]
BODY = (STREAMS / "vllm_chat_response.json").read_bytes().strip()
CHAT = "/v1/chat/completions"
REQUEST = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Scripted:
    """An upstream on its own loop: each request, on any connection, runs `script`.
    Counts connections, keeps each request's body, and notes when the proxy closed one
    (`closed`)."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.requests = 0
        self.bodies: list[bytes] = []
        self.closed = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.port = 0
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            server = self.loop.run_until_complete(
                asyncio.start_server(self._handle, "127.0.0.1", 0)
            )
            self.port = server.sockets[0].getsockname()[1]
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        ready.wait(5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                self.bodies.append(await reader.readexactly(length))
                self.requests += 1
                await self.script(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed.set()  # the proxy closed this connection
        finally:
            writer.close()

    def stop(self) -> None:
        async def cancel() -> None:
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()
            self.loop.stop()

        asyncio.run_coroutine_threadsafe(cancel(), self.loop)
        self.thread.join(5)


@pytest.fixture
def upstream() -> Iterator[Callable[[Script], Scripted]]:
    started: list[Scripted] = []

    def start(script: Script) -> Scripted:
        started.append(Scripted(script))
        return started[-1]

    yield start
    for server in started:
        server.stop()


async def wait_close(reader: asyncio.StreamReader) -> None:
    """Say nothing more; return once the proxy closes the connection."""
    await reader.read()
    raise ConnectionResetError("closed by the proxy")


def streaming(*steps: bytes | float | None) -> Script:
    """A chunked event stream: bytes are written (one write each), a float is a pause,
    None is silence until the proxy closes the connection."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD)
        for step in steps:
            if step is None:
                await writer.drain()
                await wait_close(reader)
            elif isinstance(step, float):
                await writer.drain()
                await asyncio.sleep(step)
            else:
                writer.write(chunk(step))
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    return script


def proxy_in_front(
    start_proxy: Callable[..., ProxyUnderTest], url: str, **settings: Any
) -> ProxyUnderTest:
    settings.setdefault("model_allowlist", (MODEL,))
    settings.setdefault("inject_usage", False)
    return start_proxy(url, **settings)


def requests_total(proxy: ProxyUnderTest, code: str, finish: str, error: str) -> float:
    return proxy.sample(
        "tokenprobe_requests_total",
        model=MODEL,
        endpoint=CHAT,
        code=code,
        finish_reason=finish,
        error_type=error,
    )


def in_flight(proxy: ProxyUnderTest) -> float:
    return proxy.sample("tokenprobe_requests_in_flight", model=MODEL, endpoint=CHAT)


def failures(proxy: ProxyUnderTest, stage: str) -> float:
    return proxy.sample("tokenprobe_measurement_failures_total", stage=stage)


def stream_raw(proxy: ProxyUnderTest) -> tuple[httpx.Response, list[bytes]]:
    with httpx.stream("POST", proxy.url + CHAT, json=REQUEST, timeout=20) as response:
        return response, list(response.iter_raw())


# -- the request head --------------------------------------------------------------------


def head_reply(proxy: ProxyUnderTest, headers: int) -> bytes:
    """What a request with `headers` headers (host and connection among them) gets."""
    fillers = b"".join(b"x-filler-%d: v\r\n" % i for i in range(headers - 2))
    head = b"GET /healthz HTTP/1.1\r\nhost: proxy\r\nconnection: close\r\n" + fillers + b"\r\n"
    port = int(proxy.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        reply = b""
        while part := sock.recv(65536):
            reply += part
    return reply


def test_the_head_limits_are_the_proxys_settings(
    upstream: Callable[[Script], Scripted], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    proxy = proxy_in_front(start_proxy, upstream(streaming()).url, max_headers=6)
    assert head_reply(proxy, 6).startswith(b"HTTP/1.1 200 ")
    refused = head_reply(proxy, 7)
    assert refused.startswith(b"HTTP/1.1 431 ") and b"over 6 request headers" in refused


# -- success ---------------------------------------------------------------------------


def test_streamed_success_relays_the_bytes_and_records_the_usage(
    upstream: Callable[[Script], Scripted], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    backend = upstream(streaming(*[s for e in EVENTS for s in (e, 0.002)]))
    proxy = proxy_in_front(start_proxy, backend.url)
    response, chunks = stream_raw(proxy)
    assert response.status_code == 200 and b"".join(chunks) == STREAM
    assert response.headers["x-accel-buffering"] == "no"
    record = proxy.wait_records(1, exact=True)[0]
    assert (record.status_code, record.error_type, record.finish_reason) == (200, None, "stop")
    assert (record.prompt_tokens, record.output_tokens) == (12, 4)
    assert record.token_source is TokenSource.USAGE
    assert record.ttfb is not None and record.ttft is not None
    assert record.ttfb <= record.ttft <= record.e2e
    assert requests_total(proxy, "200", "stop", "none") == 1 and in_flight(proxy) == 0


def test_non_streamed_success_keeps_its_length_and_the_connection_is_reused(
    upstream: Callable[[Script], Scripted], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    async def whole(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (len(BODY), BODY)
        )
        await writer.drain()

    backend = upstream(whole)
    proxy = proxy_in_front(start_proxy, backend.url)
    body = {**REQUEST, "stream": False}
    replies = [httpx.post(proxy.url + CHAT, json=body, timeout=10) for _ in range(3)]
    assert all(r.content == BODY for r in replies)
    assert all(r.headers["content-length"] == str(len(BODY)) for r in replies)
    assert (backend.requests, backend.connections) == (3, 1)  # one pooled connection
    assert len(proxy.wait_records(3, exact=True)) == 3


def test_unmeasured_paths_are_relayed_and_counted_by_route(
    upstream: Callable[[Script], Scripted], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    async def models(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b'HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\n{"data":[]}')
        await writer.drain()

    proxy = proxy_in_front(start_proxy, upstream(models).url)
    assert httpx.get(proxy.url + "/v1/models?x=1").content == b'{"data":[]}'
    deadline = time.monotonic() + 5
    while proxy.sample("tokenprobe_passthrough_requests_total", route="/v1/models", code="200") < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert proxy.records == []


# -- a kept-alive connection the backend closed ---------------------------------------
# A request goes once more, on a new connection, only when the connection was reused and
# the backend closed it cleanly before any byte of the answer (it never took the request).
# Each scenario runs on both paths, and on the ASGI relay's httpx transport too.

Scenario = Callable[..., None]


def once_then_close(unanswered: bytes) -> Script:
    """Each connection answers its first request with the stream; on its next one it
    writes `unanswered` and closes, as llama.cpp's server closes after a stream (with
    b"", before a byte of answer). The writers themselves are kept: a closed connection's
    id() can come back as a new connection's, which then looked answered."""
    answered: list[asyncio.StreamWriter] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if any(seen is writer for seen in answered):
            writer.write(unanswered)
            await writer.drain()
            raise ConnectionResetError("closes a kept-alive connection")
        answered.append(writer)
        await streaming(*EVENTS)(reader, writer)

    return script


def goes_once_more_anew(
    relay: str,
    upstream: Callable[[Script], Scripted],
    start_proxy: Callable[..., ProxyUnderTest],
    **settings: Any,
) -> None:
    backend = upstream(once_then_close(b""))
    proxy = proxy_in_front(start_proxy, backend.url, **settings)
    for _ in range(3):
        response, chunks = stream_raw(proxy)
        assert response.status_code == 200 and b"".join(chunks) == STREAM
    # Each connection answers once. The second request finds the first one closed and
    # goes once more; the wire keeps that new connection, so the third request finds it
    # closed too, while the ASGI relay's resend goes on a connection it does not keep.
    resent = 2 if relay == "wire" else 1
    assert (backend.connections, backend.requests) == (3, 3 + resent)
    assert len(set(backend.bodies)) == 1  # the same body each time, whole
    records = proxy.wait_records(3, exact=True)  # each request measured once
    assert all(r.error_type is None and r.status_code == 200 for r in records)
    assert all(r.ttft is not None for r in records)


def part_of_an_answer_is_not_tried_again(
    relay: str,
    upstream: Callable[[Script], Scripted],
    start_proxy: Callable[..., ProxyUnderTest],
    **settings: Any,
) -> None:
    backend = upstream(once_then_close(b"HTTP/1.1 200"))
    proxy = proxy_in_front(start_proxy, backend.url, **settings)
    assert stream_raw(proxy)[0].status_code == 200
    assert stream_raw(proxy)[0].status_code == 502
    assert (backend.connections, backend.requests) == (1, 2)


def a_fresh_connection_is_not_tried_again(
    relay: str,
    upstream: Callable[[Script], Scripted],
    start_proxy: Callable[..., ProxyUnderTest],
    **settings: Any,
) -> None:
    backend = upstream(never)
    proxy = proxy_in_front(start_proxy, backend.url, **settings)
    response, _ = stream_raw(proxy)
    assert response.status_code == 502
    assert (backend.connections, backend.requests) == (1, 1)
    (record,) = proxy.wait_records(1, exact=True)
    assert record.error_type is ErrorType.UPSTREAM_ERROR


async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    raise ConnectionResetError("closes unanswered")


def test_a_request_on_a_kept_alive_connection_the_backend_closed_goes_once_more_anew(
    relay: str, upstream: Callable[[Script], Scripted], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    goes_once_more_anew(relay, upstream, start_proxy)


def test_a_kept_alive_connection_closed_after_part_of_an_answer_is_not_tried_again(
    relay: str, upstream: Callable[[Script], Scripted], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    part_of_an_answer_is_not_tried_again(relay, upstream, start_proxy)


def test_a_fresh_connection_closed_unanswered_is_not_tried_again(
    relay: str, upstream: Callable[[Script], Scripted], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    a_fresh_connection_is_not_tried_again(relay, upstream, start_proxy)


def test_an_idempotent_request_on_a_fresh_connection_is_not_tried_again_either(
    upstream: Callable[[Script], Scripted], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    # aiohttp on its own sends a GET again after any disconnect; the rule is the wire's.
    backend = upstream(never)
    proxy = proxy_in_front(start_proxy, backend.url)
    assert httpx.get(proxy.url + "/v1/models", timeout=10).status_code == 502
    assert (backend.connections, backend.requests) == (1, 1)


@paths("asgi", why="--upstream-transport picks the ASGI relay's client; the wire has its own")
@pytest.mark.parametrize(
    "scenario",
    [
        goes_once_more_anew,
        part_of_an_answer_is_not_tried_again,
        a_fresh_connection_is_not_tried_again,
    ],
    ids=lambda scenario: scenario.__name__,
)
def test_the_httpx_transport_goes_once_more_by_the_same_rule(
    scenario: Scenario,
    relay: str,
    upstream: Callable[[Script], Scripted],
    start_proxy: Callable[..., ProxyUnderTest],
) -> None:
    scenario(relay, upstream, start_proxy, upstream_transport="httpx")


# -- before the response head ----------------------------------------------------------


def test_an_unreachable_upstream_answers_502(start_proxy: Callable[..., ProxyUnderTest]) -> None:
    from tests.servers import free_port

    proxy = proxy_in_front(start_proxy, f"http://127.0.0.1:{free_port()}")
    reply = httpx.post(proxy.url + CHAT, json=REQUEST, timeout=10)
    assert reply.status_code == 502 and reply.json()["error"]["type"] == "upstream_unreachable"
    assert proxy.wait_records(1)[0].error_type is ErrorType.UPSTREAM_UNREACHABLE


def test_no_head_within_the_first_byte_timeout_answers_504_and_closes_upstream(
    upstream: Callable[[Script], Scripted], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await wait_close(reader)

    backend = upstream(silent)
    proxy = proxy_in_front(start_proxy, backend.url, first_byte_timeout=0.3)
    reply = httpx.post(proxy.url + CHAT, json=REQUEST, timeout=10)
    assert reply.status_code == 504 and reply.json()["error"]["type"] == "upstream_timeout"
    assert backend.closed.wait(5)
    assert proxy.wait_records(1)[0].error_type is ErrorType.UPSTREAM_TIMEOUT


def test_each_wait_has_its_own_limit_on_the_requests_one_timer(
    upstream: Callable[[Script], Scripted], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    # The wire's one timer per request (WireRequest._look, proxy/server/deadline.py) is
    # armed at the head for --body-timeout: firing after the body came in, it must not cut;
    # after the response head the first-byte limit no longer applies, only the gaps
    # between reads.
    stream = streaming(EVENTS[0], 0.6, EVENTS[1], 0.6, *EVENTS[2:])

    async def late(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.5)  # past --body-timeout, within --first-byte-timeout
        await stream(reader, writer)

    proxy = proxy_in_front(
        start_proxy,
        upstream(late).url,
        body_timeout=0.2,
        first_byte_timeout=1.5,  # the stream ends about 1.7 s after it went upstream
        idle_timeout=2.0,  # well over the 0.6 s gaps on a loaded machine
    )
    with httpx.stream("POST", proxy.url + CHAT, json=REQUEST, timeout=10) as response:
        got = b"".join(response.iter_raw())
    assert (response.status_code, got) == (200, b"".join(EVENTS))
    record = proxy.wait_records(1)[0]
    assert (record.status_code, record.error_type) == (200, None)


def test_an_error_status_is_relayed_unchanged_and_classified(
    upstream: Callable[[Script], Scripted], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    error = (
        b'{"error":{"message":"maximum context length is 8","type":"BadRequestError","code":400}}'
    )

    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(error), error)
        )
        await writer.drain()

    proxy = proxy_in_front(start_proxy, upstream(refuse).url)
    reply = httpx.post(proxy.url + CHAT, json=REQUEST, timeout=10)
    assert (reply.status_code, reply.content) == (400, error)
    assert proxy.wait_records(1)[0].error_type is ErrorType.CONTEXT_LENGTH


# -- after the response head -----------------------------------------------------------


def test_a_break_after_the_head_relays_what_came_then_drops_the_client(
    upstream: Callable[[Script], Scripted], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    async def breaks(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + chunk(EVENTS[0]))
        await writer.drain()
        writer.transport.abort()
        raise ConnectionResetError

    proxy = proxy_in_front(start_proxy, upstream(breaks).url)
    got: list[bytes] = []
    with (
        pytest.raises(httpx.RemoteProtocolError),
        httpx.stream("POST", proxy.url + CHAT, json=REQUEST, timeout=10) as response,
    ):
        got.extend(response.iter_raw())
    assert b"".join(got) == EVENTS[0]
    record = proxy.wait_records(1)[0]
    assert (record.status_code, record.error_type) == (200, ErrorType.STREAM_TRUNCATED)
    assert in_flight(proxy) == 0


def test_an_idle_upstream_is_cut_after_the_idle_timeout(
    upstream: Callable[[Script], Scripted], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    backend = upstream(streaming(EVENTS[0], None))
    proxy = proxy_in_front(start_proxy, backend.url, idle_timeout=0.3)
    with (
        pytest.raises(httpx.RemoteProtocolError),
        httpx.stream("POST", proxy.url + CHAT, json=REQUEST, timeout=10) as response,
    ):
        list(response.iter_raw())
    assert backend.closed.wait(5)
    assert proxy.wait_records(1)[0].error_type is ErrorType.UPSTREAM_TIMEOUT


@paths("wire", why="the wire's own cut (Wire.close); the ASGI relay's is test_relay_inprocess.py")
def test_the_drain_cut_mid_stream_records_stream_truncated_and_drops_the_client(
    upstream: Callable[[Script], Scripted], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    backend = upstream(streaming(EVENTS[0], None))
    proxy = proxy_in_front(start_proxy, backend.url)
    with (
        pytest.raises(httpx.RemoteProtocolError),
        httpx.stream("POST", proxy.url + CHAT, json=REQUEST, timeout=10) as response,
    ):
        stream = response.iter_raw()
        assert next(stream) == EVENTS[0]
        cut_in_flight(proxy)  # what the server's drain timeout ending does
        list(stream)
    assert backend.closed.wait(5)
    record = proxy.wait_records(1)[0]
    assert (record.status_code, record.error_type) == (200, ErrorType.STREAM_TRUNCATED)


@paths("wire", why="the wire's own cut (Wire.close); the ASGI relay's is test_relay_inprocess.py")
def test_the_drain_cut_before_the_head_answers_503(
    upstream: Callable[[Script], Scripted], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    reached = threading.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reached.set()
        await wait_close(reader)

    proxy = proxy_in_front(start_proxy, upstream(silent).url)
    result: dict[str, httpx.Response] = {}
    client = threading.Thread(
        target=lambda: result.update(r=httpx.post(proxy.url + CHAT, json=REQUEST, timeout=10))
    )
    client.start()
    assert reached.wait(5)
    cut_in_flight(proxy)
    client.join(10)
    assert result["r"].status_code == 503
    assert result["r"].json()["error"]["type"] == "proxy_shutting_down"


def cut_in_flight(proxy: ProxyUnderTest) -> None:
    """Run the wire's end-of-drain cut on the server's loop."""
    wire = proxy.app.wire
    loop = proxy.server.loop
    assert wire is not None and loop is not None
    done = threading.Event()

    def cut() -> None:
        wire.close()
        done.set()

    loop.call_soon_threadsafe(cut)
    assert done.wait(5)


# -- the drain's end, on both paths -------------------------------------------------------


def drain_ends(proxy: ProxyUnderTest) -> None:
    """What uvicorn's shutdown does once --drain-timeout has run out, on the server's loop:
    each connection told of the drain (`shutdown`, at the drain's start in uvicorn), the
    requests' tasks cancelled (the ASGI relay's), and the lifespan's cut (Wire.close)."""
    server, loop, wire = proxy.server.server, proxy.server.loop, proxy.app.wire
    assert loop is not None
    done = threading.Event()

    def end() -> None:
        for connection in list(server.server_state.connections):
            connection.shutdown()
        for task in server.server_state.tasks:
            task.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
        if wire is not None:
            wire.close()
        done.set()

    loop.call_soon_threadsafe(end)
    assert done.wait(5)


def wait_until(ready: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, "never ready"
        time.sleep(0.01)


def a_turn_came(proxy: ProxyUnderTest) -> bool:
    """A request's head is in and its turn came (the data path runs it)."""
    connections = list(proxy.server.server.server_state.connections)
    return any(connection.running is not None for connection in connections)


def post_head(length: int) -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % (CHAT.encode(), length)
    )


def read_to_close(sock: socket.socket) -> bytes:
    """What the proxy sent until it closed the connection (or said nothing for 5 s)."""
    sock.settimeout(5)
    reply = b""
    try:
        while part := sock.recv(65536):
            reply += part
    except TimeoutError:
        pass
    return reply


def test_the_drain_end_answers_503_to_a_request_still_sending_its_body(
    upstream: Callable[[Script], Scripted], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """Its answer has not begun by the drain's limit: the 503 any such request gets, its
    record, and the connection closed. The wire once closed it silently, unrecorded; the
    ASGI relay let uvicorn's cancellation escape (uvicorn's 500, no record)."""
    backend = upstream(never)
    proxy = proxy_in_front(start_proxy, backend.url)
    port = int(proxy.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(post_head(100) + b'{"model":"')  # 10 of its 100 bytes
        wait_until(lambda: a_turn_came(proxy))
        drain_ends(proxy)
        reply = read_to_close(sock)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 "), reply
    assert b"connection: close" in head.lower()
    assert orjson.loads(body)["error"]["type"] == "proxy_shutting_down"
    record = proxy.wait_records(1, exact=True)[0]
    assert (record.status_code, record.error_type) == (503, ErrorType.UPSTREAM_ERROR)
    assert backend.connections == 0


def running_with_one_pipelined(
    upstream: Callable[[Script], Scripted], start_proxy: Callable[..., ProxyUnderTest]
) -> tuple[ProxyUnderTest, socket.socket]:
    """A stream under way (its first event at the client, then silence) and a second
    request pipelined behind it that has waited 0.3 s for its turn."""
    proxy = proxy_in_front(start_proxy, upstream(streaming(EVENTS[0], None)).url)
    body = orjson.dumps(REQUEST)
    port = int(proxy.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall((post_head(len(body)) + body) * 2)
    seen = b""
    while EVENTS[0] not in seen:
        seen += sock.recv(65536)
    time.sleep(0.3)
    return proxy, sock


def never_answered(proxy: ProxyUnderTest) -> Measurement:
    """The record of the pipelined request: nothing went out to it (status 0)."""
    records = proxy.wait_records(2, exact=True)
    return next(record for record in records if record.status_code == 0)


def test_a_pipelined_request_whose_client_left_is_timed_from_its_arrival(
    upstream: Callable[[Script], Scripted], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """Its record's e2e is its wait, as every request's runs from its head. The ASGI relay
    once timed it from the moment it recorded it (0.1 ms)."""
    proxy, sock = running_with_one_pipelined(upstream, start_proxy)
    sock.close()
    record = never_answered(proxy)
    assert record.error_type is ErrorType.CLIENT_CANCELLED
    assert record.e2e >= 0.3, record.e2e


def test_a_pipelined_request_the_drain_end_dropped_is_no_client_cancellation(
    upstream: Callable[[Script], Scripted], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """The running stream is cut at the drain's limit and its connection dropped, the
    request behind it with it: its client never left, so upstream_error (the proxy shut
    down before its turn), as every request the shutdown leaves unanswered."""
    proxy, sock = running_with_one_pipelined(upstream, start_proxy)
    with sock:
        drain_ends(proxy)
        read_to_close(sock)
    record = never_answered(proxy)
    assert record.error_type is ErrorType.UPSTREAM_ERROR
    assert record.error_message is not None and "before its turn" in record.error_message
    assert record.e2e >= 0.3, record.e2e


# -- the client leaves -----------------------------------------------------------------


@pytest.mark.parametrize("when", ["before the head", "mid-stream"])
def test_a_client_that_leaves_closes_the_upstream_at_once_and_is_recorded(
    when: str, upstream: Callable[[Script], Scripted], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    reached = threading.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reached.set()
        if when == "mid-stream":
            writer.write(SSE_HEAD + chunk(EVENTS[0]))
            await writer.drain()
        await wait_close(reader)

    backend = upstream(script)
    proxy = proxy_in_front(start_proxy, backend.url)
    body = orjson.dumps(REQUEST)
    port = int(proxy.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (CHAT.encode(), len(body), body)
        )
        assert reached.wait(5)
        if when == "mid-stream":
            seen = b""
            while EVENTS[0] not in seen:
                seen += sock.recv(65536)
        left = time.monotonic()
    assert backend.closed.wait(5)
    assert time.monotonic() - left < 2  # generous: the close is one callback away
    record = proxy.wait_records(1)[0]
    assert record.error_type is ErrorType.CLIENT_CANCELLED
    assert in_flight(proxy) == 0


def test_a_pooled_connection_is_never_one_that_carried_an_abandoned_response(
    upstream: Callable[[Script], Scripted], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    backend = upstream(streaming(EVENTS[0], 0.05, *EVENTS[1:]))
    proxy = proxy_in_front(start_proxy, backend.url)
    with httpx.stream("POST", proxy.url + CHAT, json=REQUEST, timeout=10) as response:
        assert next(response.iter_raw()) == EVENTS[0]  # then the client leaves
    assert backend.closed.wait(5)
    _, chunks = stream_raw(proxy)
    assert b"".join(chunks) == STREAM
    assert backend.connections == 2  # the abandoned one was closed, not reused


# -- backpressure ----------------------------------------------------------------------


def test_a_client_that_does_not_read_stops_the_proxy_reading_the_upstream(
    upstream: Callable[[Script], Scripted], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    piece = b"data: " + b"x" * 65_000 + b"\n\n"
    # 52 MB: several times what the loopback sockets alone hold. Those held 9-13 MB here
    # on both paths (139-157 pieces, 200 once), so a 26 MB flood's half was no margin.
    total = 800
    written = [0]

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD)
        for _ in range(total):
            writer.write(chunk(piece))
            await writer.drain()  # waits while the proxy is not reading
            written[0] += 1
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    proxy = proxy_in_front(start_proxy, upstream(flood).url, max_event_bytes=128 * 1024)
    with httpx.stream("POST", proxy.url + CHAT, json=REQUEST, timeout=30) as response:
        stream = response.iter_raw()
        first = next(stream)
        before, deadline = -1, time.monotonic() + 20
        while written[0] != before and written[0] < total and time.monotonic() < deadline:
            before = written[0]
            time.sleep(1.0)  # until the upstream makes no progress for a second
        assert written[0] < total // 2  # held back by the client, not buffered in the proxy
        received = len(first) + sum(len(c) for c in stream)
    assert received == total * len(piece) and written[0] == total
    assert proxy.wait_records(1)[0].status_code == 200


# -- measuring fails, the stream goes on -----------------------------------------------


@replaces_observer_methods
def test_an_observer_failure_keeps_the_stream_and_still_writes_a_record(
    monkeypatch: pytest.MonkeyPatch,
    upstream: Callable[[Script], Scripted],
    start_proxy: Callable[..., ProxyUnderTest],
) -> None:
    def broken_feed(self: StreamObserver, chunk: bytes, now: float) -> NoReturn:
        raise RuntimeError("observer bug")

    monkeypatch.setattr(StreamObserver, "feed", broken_feed)
    proxy = proxy_in_front(start_proxy, upstream(streaming(*EVENTS)).url)
    _, chunks = stream_raw(proxy)
    assert b"".join(chunks) == STREAM
    assert proxy.wait_records(1)[0].status_code == 200
    assert failures(proxy, "observe") == 1 and in_flight(proxy) == 0


def test_an_event_over_the_limit_is_relayed_unmeasured_and_counted(
    upstream: Callable[[Script], Scripted], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    proxy = proxy_in_front(start_proxy, upstream(streaming(*EVENTS)).url, max_event_bytes=64)
    _, chunks = stream_raw(proxy)
    assert b"".join(chunks) == STREAM
    record = proxy.wait_records(1)[0]
    assert (record.status_code, record.error_type, record.ttft) == (200, None, None)
    assert failures(proxy, "event_too_large") == 1 and failures(proxy, "observe") == 0


@replaces_observer_methods
def test_a_failure_while_finishing_still_writes_a_bare_record(
    monkeypatch: pytest.MonkeyPatch,
    upstream: Callable[[Script], Scripted],
    start_proxy: Callable[..., ProxyUnderTest],
) -> None:
    async def broken_finish(self: StreamObserver, **_: Any) -> NoReturn:
        raise RuntimeError("finish bug")

    monkeypatch.setattr(StreamObserver, "finish", broken_finish)
    proxy = proxy_in_front(start_proxy, upstream(streaming(*EVENTS)).url)
    _, chunks = stream_raw(proxy)
    assert b"".join(chunks) == STREAM
    record = proxy.wait_records(1)[0]
    assert (record.status_code, record.token_source) == (200, TokenSource.NONE)
    assert failures(proxy, "finish") == 1 and in_flight(proxy) == 0


def test_a_sink_failure_is_counted_and_the_other_sinks_go_on(
    upstream: Callable[[Script], Scripted], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    class BrokenSink:
        def record(self, measurement: Measurement, labels: Labels) -> None:
            raise RuntimeError("sink bug")

    proxy = proxy_in_front(start_proxy, upstream(streaming(*EVENTS)).url, sinks=[BrokenSink()])
    _, chunks = stream_raw(proxy)
    assert b"".join(chunks) == STREAM
    assert proxy.wait_records(1)[0].error_type is None
    assert failures(proxy, "sink") == 1
