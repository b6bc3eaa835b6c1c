"""A request pipelined behind a running one whose turn never comes: its record says why,
the same on both data paths (proxy/core/errors.py `LostTurn`).

The proxy in process (tests/conftest.py's start_proxy, on the wire and the ASGI relay), a
raw upstream (tests/hostile/peers.py) that answers the first request with the start of an
event stream and then fails it, and a client that writes both requests at once, so the
second's head is in before the first's answer is cut. What the drain's end does to such a
request is tests/server/test_exits_inprocess.py's.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Iterator

import orjson
import pytest

from proxy.core.measurement import ErrorType, Measurement
from tests.conftest import MODEL, ProxyUnderTest
from tests.hostile.peers import Conn, RawUpstream, Script, raw_upstream

CHAT = b"/v1/chat/completions"
BODY = orjson.dumps(
    {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
)
EVENT = (
    b'data: {"id":"c","object":"chat.completion.chunk","model":"%s","choices":[{"index":0,'
    b'"delta":{"content":"Hello"},"finish_reason":null}]}\n\n' % MODEL.encode()
)
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
FIRST = b"%x\r\n%b\r\n" % (len(EVENT), EVENT)
MAX_BODY = 1000  # the pipelined request refused at its head declares more


def post(length: int | None = None) -> bytes:
    """The chat request; with `length`, only a head declaring that body (refused: 413)."""
    if length is None:
        return b"POST %b HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" % CHAT + (
            b"content-length: %d\r\n\r\n%b" % (len(BODY), BODY)
        )
    return b"POST %b HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" % CHAT + (
        b"content-length: %d\r\n\r\n" % length
    )


async def breaks(conn: Conn) -> None:
    """The first event, then the upstream closes the connection mid-stream."""
    await conn.read_request()
    conn.write(SSE_HEAD + FIRST)
    await conn.drain()
    await asyncio.sleep(0.3)


async def goes_silent(conn: Conn) -> None:
    """The first event, then nothing (the proxy's --idle-timeout cuts it)."""
    await conn.read_request()
    conn.write(SSE_HEAD + FIRST)
    await conn.drain()
    await conn.wait_closed_by_peer(30)


async def trickles(conn: Conn) -> None:
    """An event every 0.1 s, for up to 10 s: the wire, not reading a connection with a
    refused request waiting, sees its client gone at a write."""
    await conn.read_request()
    conn.write(SSE_HEAD)
    for _ in range(100):
        conn.write(FIRST)
        await conn.drain()
        await asyncio.sleep(0.1)


@pytest.fixture
def upstream() -> Iterator[RawUpstream]:
    with raw_upstream() as server:
        yield server


def pipelined(proxy: ProxyUnderTest, second: bytes, *, leave: bool = False) -> bytes:
    """Both requests in one write; everything the client got until the proxy closed the
    connection, or, `leave`, until the first event, when the client closes it."""
    port = int(proxy.url.rsplit(":", 1)[1])
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(post() + second)
        while EVENT not in got:
            got += sock.recv(65536)
        if leave:
            time.sleep(0.2)  # the second request waits its turn
            return got
        while part := sock.recv(65536):
            got += part
    return got


def never_answered(proxy: ProxyUnderTest) -> Measurement:
    """The record of the request whose turn never came: nothing went out to it."""
    records = proxy.wait_records(2, exact=True)
    unanswered = [record for record in records if record.status_code == 0]
    assert len(unanswered) == 1, records
    return unanswered[0]


@pytest.mark.parametrize(
    ("script", "settings"),
    [(breaks, {}), (goes_silent, {"idle_timeout": 0.5})],
    ids=["upstream-broke", "upstream-silent"],
)
@pytest.mark.parametrize("second", [post(), post(5000)], ids=["admitted", "refused-at-head"])
def test_a_request_behind_an_answer_the_upstream_cut_is_no_client_cancellation(
    upstream: RawUpstream,
    start_proxy: Callable[..., ProxyUnderTest],
    script: Script,
    settings: dict[str, float],
    second: bytes,
) -> None:
    """The first answer is cut after its head (the upstream broke it, or went silent past
    --idle-timeout) and its connection dropped, so the client sees the break; the request
    behind it goes with the connection. Its client never left: upstream_error with no
    answer (status 0), as at the drain's end, not client_cancelled (both paths called it
    that); one the proxy had refused at its head (its 413 never went out) was not
    recorded at all."""
    upstream.default = script
    proxy = start_proxy(upstream.url, inject_usage=False, max_body_bytes=MAX_BODY, **settings)
    got = pipelined(proxy, second)
    assert got.count(b"HTTP/1.1 ") == 1, got  # the first answer's head, then the drop
    record = never_answered(proxy)
    assert record.error_type is ErrorType.UPSTREAM_ERROR
    assert record.error_message is not None and "answer before it" in record.error_message
    assert upstream.connections == 1  # the second request never went upstream


def test_a_request_refused_at_its_head_whose_client_left_before_its_turn_is_recorded(
    upstream: RawUpstream, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """Its 413 waits for the answer before it, and the client leaves first: a
    client_cancelled record with no answer (status 0), as any request whose client left
    before its turn; both paths once left it without a record."""
    upstream.default = trickles
    proxy = start_proxy(upstream.url, inject_usage=False, max_body_bytes=MAX_BODY)
    pipelined(proxy, post(5000), leave=True)
    record = never_answered(proxy)
    assert record.error_type is ErrorType.CLIENT_CANCELLED
    assert record.e2e >= 0.2, record.e2e  # timed from its head's arrival
