"""The upstream refuses a WebSocket handshake, end to end in this process: the tunnel behind
the test listener (tests/ws_proxy.py), a raw upstream that writes exact bytes
(tests/hostile/peers.py), a raw client that pipelines a request behind its handshake.

The refusal reaches the client as llhttp reads it, up to its end, and says the connection
closes; bytes after that end (a whole second response, which the client would take for
the answer to its pipelined request, though that request never went upstream) reach no
client and are counted `extra_bytes`, as on the wire's HTTP path. They once reached it
byte for byte, uncounted. A refusal whose body goes quiet before its end is cut at
--idle-timeout, as the HTTP relay cuts a response body, not held for --ws-idle-timeout."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest

from proxy.core.measurement import ErrorType
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


def test_a_refusal_whose_body_goes_quiet_is_cut_at_the_http_idle_timeout(
    upstream: RawUpstream,
) -> None:
    """A 403 with neither length nor chunks (its body runs to the close) that sends a few
    bytes and then nothing, keeping its connection open. It is an ordinary response (as
    nginx, which tunnels only a 101, reads it under proxy_read_timeout): the client gets
    what came, and at --idle-timeout (1 s here) of silence both connections close, as the
    HTTP relay cuts a response body that goes quiet. The session is `refused` (status
    403) and the refusal's record says what the HTTP record says of such a cut:
    upstream_timeout, "no data from the upstream for 1 s". Both were held until
    --ws-idle-timeout (300 s), which judges an open tunnel, and the refusal went
    unrecorded (`idle_timeout`)."""
    head = b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/json\r\n\r\n"
    part = b'{"error": {"message": "Invalid API key'  # and then nothing
    cut: list[float] = []

    async def script(conn: Conn) -> None:
        await conn.read_request()
        conn.write(head + part)
        await conn.drain()
        sent = time.monotonic()
        if await conn.wait_closed_by_peer(timeout=30.0):
            cut.append(time.monotonic() - sent)

    upstream.default = script
    proxy = TunnelListener(upstream.url, idle_timeout=1.0, ws_idle_timeout=300.0).start()
    try:
        started = time.monotonic()
        got, closed = until_closed(proxy.port, ws_head(), timeout=30.0)
        took = time.monotonic() - started
        relayed = head.replace(b"Forbidden\r\n", b"Forbidden\r\nconnection: close\r\n")
        assert got == relayed + part, got
        assert closed and 0.9 <= took < 20.0, (closed, took)  # 1 s, far from 300 s
        _wait(lambda: proxy.open_tunnels() == 0)
        assert upstream.wait_for(lambda: bool(cut), timeout=10.0), "the upstream was kept"
        assert proxy.sample(SESSIONS, route="/v1/realtime", outcome="refused") == 1
        ((session,), (record,)) = proxy.recorder.sessions, proxy.recorder.records
        assert (session.status, session.error) == (403, "no data from the upstream for 1 s")
        assert (record.status_code, record.error_type, record.error_message) == (
            403,
            ErrorType.UPSTREAM_TIMEOUT,
            "no data from the upstream for 1 s",
        )
    finally:
        proxy.stop()


def test_a_refusal_whose_client_takes_nothing_is_cut_as_the_clients_stall(
    upstream: RawUpstream,
) -> None:
    """The other way a refusal's body goes quiet: the upstream sends 8 MiB and the client
    reads none of it (the proxy's write buffer to it full, the upstream's reading paused).
    At --idle-timeout the proxy lets go, as the HTTP relay does of a client that takes
    nothing (client_cancelled, "the client took no bytes for ..."), not the upstream's
    timeout: the upstream was not silent. It held both until --ws-idle-timeout."""
    body = b"x" * (8 << 20)
    head = b"HTTP/1.1 403 Forbidden\r\nContent-Length: %d\r\n\r\n" % len(body)

    async def script(conn: Conn) -> None:
        await conn.read_request()
        conn.write(head + body)
        try:
            await conn.drain()
        except ConnectionError:
            return
        await conn.wait_closed_by_peer(timeout=30.0)

    upstream.default = script
    proxy = TunnelListener(upstream.url, idle_timeout=1.0, ws_idle_timeout=300.0).start()
    try:
        with socket.socket() as client:
            # a small receive window of its own (no autotuning): the client's fills fast
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            client.settimeout(10)
            client.connect(("127.0.0.1", proxy.port))
            client.sendall(ws_head())
            _wait(lambda: bool(proxy.recorder.sessions), timeout=30.0)  # never read
        assert proxy.sample(SESSIONS, route="/v1/realtime", outcome="refused") == 1
        ((session,), (record,)) = proxy.recorder.sessions, proxy.recorder.records
        words = "the client took no bytes for 1 s (--idle-timeout)"
        assert (session.status, session.error) == (403, words)
        assert (record.status_code, record.error_type, record.error_message) == (
            403,
            ErrorType.CLIENT_CANCELLED,
            words,
        )
    finally:
        proxy.stop()
