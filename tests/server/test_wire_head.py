"""A HEAD request's answer on the wire's pooled upstream connections.

Its answer ends at its head whatever its framing says (RFC 9112 §6.3, item 1), which
llhttp cannot be told: the wire ends the answer there (proxy/server/wire/upstream.py
`ended_at_head`) and closes the connection after it, never pooled, on every path (a body a
broken server sent late would be the next request's answer: docs/hostile-peers.md). What
is here is the wire's own: an answer framed by nothing, and the wire's parser, which reads
on after the head within the same read.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

import pytest

from tests.conftest import ProxyUnderTest
from tests.hostile.peers import Conn, RawUpstream, Script, ok, raw_upstream
from tests.server.conftest import paths

pytestmark = paths("wire", why="the wire's own parser and pool; the ASGI relay's are aiohttp's")

HEAD = b"HEAD /v1/models HTTP/1.1\r\nhost: x\r\n\r\n"
GET = b"GET /v1/after HTTP/1.1\r\nhost: x\r\n\r\n"


@pytest.fixture
def upstream() -> Iterator[RawUpstream]:
    with raw_upstream() as server:
        yield server


def answering(head: bytes) -> Script:
    async def script(conn: Conn) -> None:
        while (request := await conn.read_request()) is not None:
            conn.write(head if request.line.startswith(b"HEAD ") else ok(b"after"))
            await conn.drain()

    return script


def answers(proxy: ProxyUnderTest, *requests: bytes) -> list[bytes]:
    """Each request on one client connection, in turn: what came back for it."""
    port = int(proxy.url.rsplit(":", 1)[1])
    got = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for request in requests:
            sock.sendall(request)
            sock.settimeout(0.3)
            reply = b""
            try:
                while part := sock.recv(65536):
                    reply += part
            except TimeoutError:
                pass
            got.append(reply)
    return got


def errors(proxy: ProxyUnderTest, kind: str) -> float:
    return proxy.sample("tokenprobe_upstream_protocol_errors_total", kind=kind)


@pytest.mark.parametrize(
    ("head", "connections"),
    [
        (b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\n", 3),
        (b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\n\r\n", 3),
        (b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n", 3),
        (b"HTTP/1.0 200 OK\r\n\r\n", 3),
    ],
    ids=["http-1.1", "http-1.0-keep-alive", "close", "http-1.0"],
)
def test_a_head_answer_framed_by_nothing_ends_at_its_head_on_a_connection_of_its_own(
    upstream: RawUpstream,
    start_proxy: Callable[..., ProxyUnderTest],
    head: bytes,
    connections: int,
) -> None:
    """No length and no chunks: llhttp would read such a body to the close; a HEAD's
    answer has none, so it ends at its head, whatever the head says of keeping alive, and
    its connection closes after it (each of the three requests on a connection of its
    own)."""
    upstream.default = answering(head)
    proxy = start_proxy(upstream.url)
    got = answers(proxy, HEAD, HEAD, GET)
    assert [reply.split(b"\r\n", 1)[0] for reply in got[:2]] == [b"HTTP/1.1 200 OK"] * 2, got
    assert all(reply.endswith(b"\r\n\r\n") for reply in got[:2]), got
    assert got[2].endswith(b"\r\n\r\nafter"), got[2]
    assert upstream.connections == connections
    assert errors(proxy, "extra_bytes") == errors(proxy, "malformed") == 0


def test_a_body_after_a_head_answer_breaks_its_connection(
    upstream: RawUpstream, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """A backend that answers HEAD as GET, its body in the same write: the client gets
    the head alone, those bytes are no request's (`extra_bytes`, the connection closed),
    and the next request gets its own answer on a new connection."""
    upstream.default = answering(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello")
    proxy = start_proxy(upstream.url)
    head, after = answers(proxy, HEAD, GET)
    assert head == b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n", head
    assert after.endswith(b"\r\n\r\nafter"), after
    assert errors(proxy, "extra_bytes") == 1
    assert upstream.connections == 2
