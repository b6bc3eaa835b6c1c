"""Requests pipelined behind a running one, on both data paths: at most MAX_WAITING wait
their turn (proxy/server/protocol.py). llhttp parses a whole read at once, and pausing
reading only stops the next read: one write of ~9,000 tiny GETs behind a request the
upstream held became 9,000 request objects (the ASGI relay grew 57 -> 305 MiB for ten
such connections of 250 KB). Past the bound the connection is parsed no further: those
waiting are answered in order, the last with `Connection: close`, and it closes (a
pipelining client sends again what a closing connection left unanswered, RFC 9112 §9.3.2).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import pytest

from proxy.server.protocol import MAX_WAITING
from tests.hostile.client import responses, whole
from tests.hostile.peers import Conn, RawUpstream, Script, exchange, get, ok
from tests.hostile.shared import counted

Proxy = Callable[..., AbstractContextManager[str]]
HELD = b"/v1/held"
CLOSED = "tokenprobe_connections_closed_total"


def echoing(hold: float) -> Script:
    """Each request answered with its own target as the body; `HELD` after `hold` seconds,
    so that the requests pipelined behind it are all parsed while it runs."""

    async def script(conn: Conn) -> None:
        while (request := await conn.read_request()) is not None:
            if request.target == HELD:
                await asyncio.sleep(hold)
            conn.write(ok(request.target))
            await conn.drain()

    return script


def pipelined(count: int) -> bytes:
    """`HELD`, then `count` GETs numbered from 0, as one write."""
    return get(HELD) + b"".join(get(b"/v1/n/%d" % i) for i in range(count))


def read_until_close(base: str, data: bytes, timeout: float = 10.0) -> tuple[bytes, bool]:
    """Write `data` on a new connection; what came back, and whether the proxy closed the
    connection within `timeout` (False: still open, silent for 2 s after its last byte)."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    got = bytearray()
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(data)
        while True:
            sock.settimeout(2.0 if got else timeout)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                return bytes(got), False
            except ConnectionError:
                return bytes(got), True
            if not chunk:
                return bytes(got), True
            got += chunk


def read_through(sock: socket.socket, last_body: bytes) -> bytes:
    """What `sock` receives up to the end of an answer whose body is `last_body` (answers
    come coalesced into one read or split across several, as the proxy's writes fall)."""
    got = bytearray()
    while not got.endswith(b"\r\n\r\n" + last_body):
        chunk = sock.recv(65536)
        assert chunk, f"closed before the answer {last_body!r}: {bytes(got)!r}"
        got += chunk
    return bytes(got)


def test_a_flood_pipelined_behind_a_held_request_is_answered_to_the_bound_then_closed(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """3,000 GETs pipelined behind a held request in one write: the held one and the
    MAX_WAITING after it are answered in order (no more reach the upstream), the last
    says Connection: close, and the connection closes; a fresh one is served as ever."""
    upstream.default = echoing(hold=0.3)
    with proxy(upstream.url) as base:
        got, closed = read_until_close(base, pipelined(3000))
        stopped = counted(base, CLOSED, reason="too_many_pipelined")
        assert exchange(base, get(b"/v1/fresh"), idle=0.5, done=whole()).startswith(b"HTTP/1.1 200")
    answers = responses(got)
    expected = [HELD] + [b"/v1/n/%d" % i for i in range(MAX_WAITING)]
    assert [(status, body) for status, _, body in answers] == [(200, t) for t in expected]
    closes = [b"connection: close" in head.lower() for _, head, _ in answers]
    assert closes == [False] * MAX_WAITING + [True]
    assert closed, "the connection stayed open after the last answer"
    assert [r.target for r in upstream.requests] == [*expected, b"/v1/fresh"]
    assert stopped == 1


@pytest.mark.parametrize("count", [3, MAX_WAITING], ids=["a-few", "the-bound"])
def test_requests_pipelined_up_to_the_bound_are_each_answered_in_order(
    upstream: RawUpstream, proxy: Proxy, count: int
) -> None:
    """Up to MAX_WAITING waiting behind a held request: every one answered, in order, and
    the connection stays open for the next request."""
    upstream.default = echoing(hold=0.3)
    with proxy(upstream.url) as base:
        host, port = base.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(pipelined(count))
            got = read_through(sock, b"/v1/n/%d" % (count - 1))
            sock.sendall(get(b"/v1/after"))  # on the same connection, once they are in
            got += read_through(sock, b"/v1/after")
        stopped = counted(base, CLOSED, reason="too_many_pipelined")
    expected = [HELD] + [b"/v1/n/%d" % i for i in range(count)] + [b"/v1/after"]
    answers = responses(got)
    assert [(status, body) for status, _, body in answers] == [(200, t) for t in expected]
    assert not any(b"connection: close" in head.lower() for _, head, _ in answers)
    assert stopped == 0


def test_a_client_that_leaves_after_a_flood_cancels_the_held_request(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """Past the bound the connection is still read (and what comes dropped), so a client
    that leaves is seen while the upstream holds the request before them: the upstream
    request is cancelled at once. The wire, its reading paused, once left the close unseen
    (CLOSE-WAIT) until the held request ended, up to --first-byte-timeout; the ASGI relay
    saw it (its app's receive resumes reading), after parsing all that came before."""
    closed_after: list[float] = []

    async def holding(conn: Conn) -> None:
        await conn.read_request()
        started = time.monotonic()
        if await conn.wait_closed_by_peer(timeout=8.0):
            closed_after.append(time.monotonic() - started)

    upstream.default = holding
    with proxy(upstream.url) as base:
        host, port = base.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(pipelined(3000))
            assert upstream.wait_for(lambda: len(upstream.requests) == 1, 5)
            time.sleep(0.3)
        assert upstream.wait_for(lambda: bool(closed_after), 6), "the held request ran on"
    assert closed_after[0] < 3.0, closed_after
    assert [r.target for r in upstream.requests] == [HELD]
