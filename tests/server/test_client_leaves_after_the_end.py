"""A client that closes its connection once it has read the stream's end marker, before
the chunked body's terminator came, received the whole answer: no cancellation.

The official OpenAI SDK does exactly this: its `Stream.__stream__` breaks out of its loop
at `data: [DONE]` and closes the response (openai/_streaming.py), so when the terminator
(`0\\r\\n\\r\\n`) is still on its way, httpx closes the connection. A backend writes the two
apart (starlette's StreamingResponse sends the last event, then an empty `more_body:
False`), and under load the proxy reads them apart: once in CI, one turn of an SDK agent
loop was recorded `client_cancelled` with its whole answer delivered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from tests.conftest import ProxyUnderTest
from tests.edge_backend import SSE_USAGE_STREAM, RawBackend, Responder

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
