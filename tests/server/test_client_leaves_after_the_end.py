"""A client that closes its connection once it has read the stream's end marker, before
the chunked body's terminator came, received the whole answer: no cancellation. One that
closes before it was given the end is cancelled, even where the proxy read that end.

The official OpenAI SDK does exactly this: its `Stream.__stream__` breaks out of its loop
at `data: [DONE]` and closes the response (openai/_streaming.py), so when the terminator
(`0\\r\\n\\r\\n`) is still on its way, httpx closes the connection. A backend writes the two
apart (starlette's StreamingResponse sends the last event, then an empty `more_body:
False`), and under load the proxy reads them apart: once in CI, one turn of an SDK agent
loop was recorded `client_cancelled` with its whole answer delivered.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from proxy.core.measurement import ErrorType
from tests.conftest import ProxyUnderTest
from tests.edge_backend import SSE_USAGE_STREAM, RawBackend, Responder
from tests.server.conftest import paths

#: How long the backend holds the terminator back after [DONE].
LATE = 0.5
MODEL = "m"
#: The stream's role and content events; then its finish, usage and [DONE].
EVENTS = [event + b"\n\n" for event in SSE_USAGE_STREAM.split(b"\n\n") if event]
OPENING, CLOSING = b"".join(EVENTS[:2]), b"".join(EVENTS[2:])


def chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(body), body)


def responder(before_end: float) -> Responder:
    """A whole chat stream, chunked: its opening events; `before_end` seconds later its
    finish, usage and [DONE]; the terminator LATE seconds after that."""

    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + chunked(OPENING)
        )
        await writer.drain()
        for pause, piece in ((before_end, chunked(CLOSING)), (LATE, b"0\r\n\r\n")):
            await asyncio.sleep(pause)
            writer.write(piece)
            await writer.drain()
        await reader.read()  # until the proxy lets go

    return respond


def proxied(start_proxy: Callable[..., ProxyUnderTest], before_end: float) -> ProxyUnderTest:
    server = RawBackend(responder=responder(before_end)).start()
    running = start_proxy(server.url, model_allowlist=(MODEL,))
    STARTED.append(server)
    return running


STARTED: list[RawBackend] = []
CANCELLED = ErrorType.CLIENT_CANCELLED


@pytest.fixture(autouse=True)
def _stop_backends() -> Iterator[None]:
    yield
    while STARTED:
        STARTED.pop().stop()


def test_the_sdk_closing_at_done_is_a_whole_answer(
    start_proxy: Callable[..., ProxyUnderTest],
) -> None:
    proxy = proxied(start_proxy, before_end=0)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-test", max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == "Hello"
    (m,) = proxy.wait_records(1, exact=True)
    assert (m.status_code, m.error_type, m.error_message) == (200, None, None)
    assert (m.output_tokens, m.finish_reason) == (1, "stop")
    # The answer ended with [DONE], read at once: not when the client's close was seen
    # nor when the terminator would have come.
    assert m.e2e < LATE / 2, m.e2e
    ok = {"model": MODEL, "endpoint": "/v1/chat/completions", "code": "200", "error_type": "none"}
    assert proxy.sample("tokenprobe_requests_total", **ok, finish_reason="stop") == 1


def test_a_client_that_leaves_before_its_finish_is_still_cancelled(
    start_proxy: Callable[..., ProxyUnderTest],
) -> None:
    """The same stream, the client gone before its finish came: its answer was not whole."""
    proxy = proxied(start_proxy, before_end=LATE)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body) as r:
        assert next(r.iter_raw()) == OPENING  # then gone
    (m,) = proxy.wait_records(1, exact=True)
    assert m.error_type is not None and m.error_type.value == "client_cancelled"


async def holds_the_usage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """The stream up to its finish chunk in one write, then nothing more until the proxy
    lets go: the usage chunk the proxy asked for is late (vLLM writes it after the finish
    chunk, a step or a busy loop later)."""
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n" + chunked(OPENING + EVENTS[2])
    )
    await writer.drain()
    await reader.read()


def test_a_client_that_leaves_while_the_proxy_holds_its_finish_is_cancelled(
    start_proxy: Callable[..., ProxyUnderTest],
) -> None:
    """The client asked for no usage, so the proxy asked for it and holds the finish chunk
    until the usage chunk comes, to strip that chunk (proxy/core/strip.py). The finish
    came in the read that brought the content, so the observer read it before the client
    had the content; the client then leaves without it: its answer was not whole, though
    the upstream's was. The record keeps the finish the backend sent, as any client gone
    after a finish the observer read does."""
    leaves_before_the_held_finish(start_proxy(*holding_the_usage(), model_allowlist=(MODEL,)))


@paths("asgi", why="the ASGI relay's httpx transport; the two paths run above")
def test_a_client_that_leaves_while_the_proxy_holds_its_finish_is_cancelled_on_httpx(
    start_proxy: Callable[..., ProxyUnderTest],
) -> None:
    proxy = start_proxy(*holding_the_usage(), model_allowlist=(MODEL,), upstream_transport="httpx")
    leaves_before_the_held_finish(proxy)


def holding_the_usage() -> tuple[str]:
    server = RawBackend(responder=holds_the_usage).start()
    STARTED.append(server)
    return (server.url,)


def leaves_before_the_held_finish(proxy: ProxyUnderTest) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    got = b""
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body, timeout=30) as r:
        for piece in r.iter_raw():
            got += piece
            if len(got) >= len(OPENING):
                break  # then gone, the finish never given
    assert got == OPENING
    (seen,) = STARTED[0].seen
    assert json.loads(seen.body)["stream_options"] == {"include_usage": True}  # so it strips
    (m,) = proxy.wait_records(1, exact=True)
    assert (m.status_code, m.error_type, m.finish_reason) == (200, CANCELLED, "stop")
    counted = {
        error: proxy.sample(
            "tokenprobe_requests_total",
            model=MODEL,
            endpoint="/v1/chat/completions",
            code="200",
            error_type=error,
            finish_reason="stop",
        )
        for error in ("client_cancelled", "none")
    }
    assert counted == {"client_cancelled": 1, "none": 0}
