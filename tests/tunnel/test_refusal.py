"""The upstream refuses a WebSocket handshake, end to end in this process: the tunnel behind
the test listener (tests/ws_proxy.py), a raw upstream that writes exact bytes
(tests/hostile/peers.py), a raw client that pipelines a request behind its handshake.

The refusal reaches the client as llhttp reads it, up to its end, and says the connection
closes; bytes after that end (a whole second response, which the client would take for
the answer to its pipelined request, though that request never went upstream) reach no
client and are counted `extra_bytes`, as on the wire's HTTP path. They once reached it
byte for byte, uncounted."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest

from tests.hostile.client import SWITCH, ws_head
from tests.hostile.peers import Conn, RawUpstream, Script, raw_upstream
from tests.ws_proxy import TunnelListener

REFUSAL = b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nno"
#: What the client gets of REFUSAL: the proxy closes the connection after it, and says so.
RELAYED = REFUSAL.replace(b"Request\r\n", b"Request\r\nconnection: close\r\n", 1)
SMUGGLED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 17\r\n\r\n"
    b'{"smuggled":true}'
)
PIPELINED = b"GET /v1/models HTTP/1.1\r\nHost: proxy.example\r\n\r\n"
EXTRA = "tokenprobe_upstream_protocol_errors_total"
SESSIONS = "tokenprobe_websocket_sessions_total"


@pytest.fixture
def upstream() -> Iterator[RawUpstream]:
    with raw_upstream() as server:
        yield server


@pytest.fixture
def proxy(upstream: RawUpstream) -> Iterator[TunnelListener]:
    listener = TunnelListener(upstream.url).start()
    try:
        yield listener
    finally:
        listener.stop()


def answering(*writes: bytes, pause: float = 0.2) -> Script:
    """An upstream that reads the handshake, writes `writes` `pause` apart (each read on
    its own by the proxy, on any box not stalled that long), then keeps its end open: only
    the proxy closes."""

    async def script(conn: Conn) -> None:
        await conn.read_request()
        for i, data in enumerate(writes):
            if i:
                await asyncio.sleep(pause)
            conn.write(data)
            await conn.drain()
        await conn.wait_closed_by_peer(timeout=20.0)

    return script


def until_closed(port: int, data: bytes, timeout: float = 10.0) -> tuple[bytes, bool]:
    """Write `data`, read until the proxy closes; (what came, whether it closed)."""
    got = b""
    deadline = time.monotonic() + timeout
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as client:
        client.sendall(data)
        while time.monotonic() < deadline:
            client.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = client.recv(65536)
            except TimeoutError:
                return got, False
            if not chunk:
                return got, True
            got += chunk
    return got, False


def _wait(condition: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize(
    "writes",
    [(REFUSAL + SMUGGLED,), (REFUSAL[:-2], REFUSAL[-2:] + SMUGGLED)],
    ids=["one-read", "body-ends-in-a-later-read"],
)
def test_a_response_after_a_refusals_end_reaches_no_client(
    upstream: RawUpstream, proxy: TunnelListener, writes: tuple[bytes, ...]
) -> None:
    upstream.default = answering(*writes)
    got, closed = until_closed(proxy.port, ws_head() + PIPELINED)
    assert b"smuggled" not in got, got
    assert got == RELAYED and closed, got
    _wait(lambda: proxy.open_tunnels() == 0)
    assert [request.line for request in upstream.requests] == [
        b"GET /v1/realtime HTTP/1.1"  # the pipelined GET never went upstream
    ]
    assert proxy.sample(EXTRA, kind="extra_bytes") == 1
    assert proxy.sample(SESSIONS, route="/v1/realtime", outcome="refused") == 1


def test_a_chunked_refusal_goes_to_its_last_chunk_and_no_further(
    upstream: RawUpstream, proxy: TunnelListener
) -> None:
    head = b"HTTP/1.1 403 Forbidden\r\nTransfer-Encoding: chunked\r\n\r\n"
    upstream.default = answering(head + b"3\r\nabc\r\n0\r\n\r\n" + SMUGGLED)
    got, closed = until_closed(proxy.port, ws_head() + PIPELINED)
    assert b"smuggled" not in got, got
    relayed = head.replace(b"Forbidden\r\n", b"Forbidden\r\nconnection: close\r\n")
    assert got == relayed + b"3\r\nabc\r\n0\r\n\r\n" and closed, got
    _wait(lambda: proxy.open_tunnels() == 0)
    assert proxy.sample(EXTRA, kind="extra_bytes") == 1


def test_a_101_after_a_204_neither_reaches_the_client_nor_opens_the_tunnel(
    upstream: RawUpstream, proxy: TunnelListener
) -> None:
    """A 204 ends at its head: the 101 after it answers nothing the client asked, and the
    frame the client sent after its handshake never goes upstream."""
    upstream.default = answering(b"HTTP/1.1 204 No Content\r\n\r\n" + SWITCH)
    frame = b"\x81\x82\0\0\0\0hi"  # a masked text frame, zero key
    got, closed = until_closed(proxy.port, ws_head() + frame)
    assert b"101" not in got, got
    assert got == b"HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n" and closed, got
    _wait(lambda: proxy.open_tunnels() == 0)
    assert frame not in upstream.all_received()
    assert proxy.sample(EXTRA, kind="extra_bytes") == 1
    assert proxy.sample(SESSIONS, route="/v1/realtime", outcome="refused") == 1


def test_a_refusals_body_in_many_reads_reaches_the_client_whole_and_uncounted(
    upstream: RawUpstream, proxy: TunnelListener
) -> None:
    """Only bytes past the end are dropped: a body of 100 KB whose length came in the head
    and whose bytes come in three writes goes whole, and nothing is counted."""
    body = bytes(range(256)) * 400
    head = b"HTTP/1.1 401 Unauthorized\r\nContent-Length: %d\r\n\r\n" % len(body)
    upstream.default = answering(head + body[:10], body[10:60_000], body[60_000:])
    got, closed = until_closed(proxy.port, ws_head())
    relayed = head.replace(b"Unauthorized\r\n", b"Unauthorized\r\nconnection: close\r\n")
    assert got == relayed + body and closed, (len(got), got[:200])
    _wait(lambda: proxy.open_tunnels() == 0)
    assert proxy.sample(EXTRA, kind="extra_bytes") == 0
    assert proxy.sample(SESSIONS, route="/v1/realtime", outcome="refused") == 1


def test_a_refusal_that_already_says_it_closes_is_not_told_twice(
    upstream: RawUpstream, proxy: TunnelListener
) -> None:
    refusal = b"HTTP/1.1 403 Forbidden\r\nConnection: close\r\nContent-Length: 2\r\n\r\nno"
    upstream.default = answering(refusal)
    got, closed = until_closed(proxy.port, ws_head())
    assert got == refusal and closed, got
