"""A stream the proxy asked usage of, and strips it from, that ends early: the client still
gets every byte the upstream sent before the end, as it would direct, less only half an
event that may be the usage chunk it never asked for (proxy/core/strip.py at_break).

The stripper holds a finish chunk until the next event (the usage chunk may follow it to
take back what the backend moved there) and an unfinished event until its end; at a clean
end it lets them go, and these are the other ends: the upstream closes mid-body, goes
silent until --idle-timeout, or the server's drain time runs out. The upstream is a raw
socket, so the break is exact; the client reads raw bytes, so what it got is exact. Each
case runs on the wire, the ASGI relay on aiohttp (the two paths) and the ASGI relay on
httpx (its own test).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from proxy.core.measurement import ErrorType
from tests.conftest import MODEL, ProxyUnderTest
from tests.server.conftest import paths
from tests.servers import ThreadedServer, accept_each, read_request


def event(delta: dict[str, Any], finish: str | None) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    chunk = {"id": "c1", "object": "chat.completion.chunk", "model": MODEL, "choices": [choice]}
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


ROLE = event({"role": "assistant", "content": ""}, None)
HELLO = event({"content": "hello"}, None)
FINISH = event({}, "stop")
#: The start of the event after the finish chunk: where the usage chunk comes.
AFTER_FINISH = b'data: {"id":"c1","obj'
#: Half a content event, mid-answer: no usage chunk comes there.
MID_ANSWER = b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"del'
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class Upstream:
    """A raw-socket backend: to each request it sends `HEAD` and `answer` (raw chunked
    bytes), then closes cleanly (`silent` False) or says nothing more until the proxy
    closes. `asked` keeps whether each request asked for usage."""

    def __init__(self, answer: bytes, *, silent: bool = False) -> None:
        self.answer, self.silent = answer, silent
        self.asked: list[bool] = []
        self.listener = accept_each(self._serve, 8)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(30)
            request = read_request(conn)
            assert request is not None
            body = request[1]
            options = json.loads(body).get("stream_options") or {}
            self.asked.append(bool(options.get("include_usage")))
            conn.sendall(HEAD + self.answer)
            if self.silent:  # until the proxy gives up on it
                while conn.recv(65536):
                    pass

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def upstream() -> Iterator[Callable[..., Upstream]]:
    made: list[Upstream] = []

    def make(answer: bytes, *, silent: bool = False) -> Upstream:
        made.append(Upstream(answer, silent=silent))
        return made[-1]

    yield make
    for each in made:
        each.close()


def stream_without_usage(url: str, then: Callable[[], None] | None = None) -> tuple[bytes, bool]:
    """A raw client's chat stream that asks for no usage: the body it got (de-chunked)
    and whether it ended cleanly (the last chunk came) before the connection closed.
    `then` runs once the client has the first of the body."""
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    ).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
            b"\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body)
        )
        raw = b""
        while piece := sock.recv(65536):
            raw += piece
            if then is not None and HELLO in raw:
                then()
                then = None
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    return dechunk(rest)


def dechunk(data: bytes) -> tuple[bytes, bool]:
    out = b""
    while b"\r\n" in data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return out, True
        if len(data) < size + 2:
            break
        out, data = out + data[:size], data[size + 2 :]
    return out, False


def broke_after_finish(
    start_proxy: Callable[..., ProxyUnderTest], upstream: Callable[..., Upstream], **settings: Any
) -> None:
    backend = upstream(chunk(ROLE + HELLO + FINISH) + chunk(AFTER_FINISH))
    proxy = start_proxy(backend.url, **settings)
    got, ended = stream_without_usage(proxy.url)
    assert backend.asked == [True]  # the proxy asked, so it strips
    # the finish chunk, as direct; the start of the next event is where the usage chunk
    # comes, and may be it: held back (at_break)
    assert got == ROLE + HELLO + FINISH and not ended
    (record,) = proxy.wait_records(1, exact=True)
    assert record.error_type is ErrorType.STREAM_TRUNCATED and record.finish_reason == "stop"


def broke_mid_answer(
    start_proxy: Callable[..., ProxyUnderTest], upstream: Callable[..., Upstream], **settings: Any
) -> None:
    backend = upstream(chunk(ROLE + HELLO) + chunk(MID_ANSWER))
    proxy = start_proxy(backend.url, **settings)
    got, ended = stream_without_usage(proxy.url)
    assert backend.asked == [True]
    assert got == ROLE + HELLO + MID_ANSWER and not ended  # every byte, as direct


def went_silent_after_finish(
    start_proxy: Callable[..., ProxyUnderTest], upstream: Callable[..., Upstream], **settings: Any
) -> None:
    backend = upstream(chunk(ROLE + HELLO + FINISH), silent=True)
    proxy = start_proxy(backend.url, idle_timeout=1.0, **settings)
    got, ended = stream_without_usage(proxy.url)
    assert got == ROLE + HELLO + FINISH and not ended
    (record,) = proxy.wait_records(1, exact=True)
    assert record.error_type is ErrorType.UPSTREAM_TIMEOUT


def cut_by_the_drain(
    start_proxy: Callable[..., ProxyUnderTest], upstream: Callable[..., Upstream], **settings: Any
) -> None:
    backend = upstream(chunk(ROLE + HELLO + FINISH), silent=True)
    proxy = start_proxy(backend.url, **settings)
    # the finish chunk came in the read that brought HELLO, so it is held by then
    got, ended = stream_without_usage(proxy.url, then=lambda: end_the_drain(proxy))
    assert got == ROLE + HELLO + FINISH and not ended


def end_the_drain(proxy: ProxyUnderTest) -> None:
    """What the server does to the requests still in flight when its drain time is over
    (tests/servers.py _PromptServer.shutdown, then ProxyApp.shutdown): the ASGI relay's
    tasks cancelled, the wire's requests cut."""
    server = proxy.server
    assert isinstance(server, ThreadedServer) and server.loop is not None

    def end() -> None:
        for task in server.server.server_state.tasks:
            task.cancel()
        if proxy.app.wire is not None:
            proxy.app.wire.close()

    server.loop.call_soon_threadsafe(end)


CASES = [broke_after_finish, broke_mid_answer, went_silent_after_finish, cut_by_the_drain]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.__name__)
def test_an_early_end_gives_the_client_what_the_stripper_held(
    case: Callable[..., None],
    start_proxy: Callable[..., ProxyUnderTest],
    upstream: Callable[..., Upstream],
) -> None:
    case(start_proxy, upstream)


@paths("asgi", why="the ASGI relay's httpx transport; the two paths run above")
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.__name__)
def test_an_early_end_gives_the_client_what_the_stripper_held_on_httpx(
    case: Callable[..., None],
    start_proxy: Callable[..., ProxyUnderTest],
    upstream: Callable[..., Upstream],
) -> None:
    case(start_proxy, upstream, upstream_transport="httpx")
