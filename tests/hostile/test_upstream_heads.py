"""The rules both data paths apply to an upstream's response head and trailers, and to a
request refused at its head, each with one home: the same upstream bytes give the client
the same answer through the wire and through the ASGI relay (on either of its transports
where the transport matters).

Each test runs in a real `tokenprobe serve` in front of a `RawUpstream` (conftest.py).
Shown able to fail: each was run against the tree before the fix (docs/hostile-peers.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AbstractContextManager

import pytest

from proxy.server.protocol import MAX_RESPONSE_HEAD, header_line_bytes
from tests.hostile.client import responses, whole
from tests.hostile.peers import Conn, RawUpstream, Request, by_target, exchange, get, ok
from tests.hostile.shared import DataPath, counted, until

Proxy = Callable[..., AbstractContextManager[str]]
ERRORS = "tokenprobe_upstream_protocol_errors_total"
REQUESTS = "tokenprobe_requests_total"
SECOND = ok(b"second")

#: Trailer fields of 1000 bytes each, about 100 KiB in all: each one small, the section
#: past the 64 KiB that bounds a response head.
LONG_TRAILERS = b"".join(b"x-t%d: %b\r\n" % (i, b"a" * 1000) for i in range(100))

STREAMED = (
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"content":"Hi"},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
)


def chat_request() -> bytes:
    body = b'{"model":"m","messages":[],"stream":true}'
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%b" % (len(body), body)
    )


def test_trailers_past_the_bound_after_the_last_chunk_leave_the_body_whole(
    upstream: RawUpstream, path: DataPath
) -> None:
    """A chunked body whose last chunk came, then 100 KiB of trailer fields: the body is
    whole (trailers follow the last chunk, and no data path relays them), so the client
    gets it with its last chunk and the exchange is measured complete on every path. The
    wire cut it (no last chunk, a record of a broken upstream) where the ASGI relay's
    clients delivered it whole. The wire, which bounds trailers as it does a head, counts
    the upstream malformed and closes that connection; the next request takes a new one."""

    async def trailed(conn: Conn, request: Request) -> None:
        conn.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n"
            % (len(STREAMED), STREAMED)
            + LONG_TRAILERS
            + b"\r\n"
        )
        await conn.drain()

    upstream.default = by_target({b"/v1/chat/completions": trailed}, SECOND)
    with path.proxy(upstream.url) as base:
        got = exchange(base, chat_request(), idle=1.0, total=10.0, done=whole())
        assert got.startswith(b"HTTP/1.1 200"), got[:300]
        assert got.endswith(b"0\r\n\r\n"), got[-100:]  # the last chunk: whole
        [(_, _, streamed)] = responses(got)
        assert streamed == STREAMED
        assert until(lambda: counted(base, REQUESTS, code="200", error_type="none") == 1)
        assert counted(base, REQUESTS, error_type="upstream_broke") == 0
        next_got = exchange(base, get(b"/v1/next"), idle=1.0, done=whole())
        assert next_got.endswith(b"second"), next_got
        if path.relay == "wire":  # the one path that bounds trailers: a malformed upstream
            assert until(lambda: counted(base, ERRORS, kind="malformed") == 1)
            assert upstream.connections == 2  # that connection was not reused


def refused_at_its_head_expecting_continue(body: bytes) -> bytes:
    """A POST refused at its head (%00 in its target), whose client asked for a 100
    Continue and sent `body` anyway, in the same write."""
    return (
        b"POST /v1/%%00 HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
        b"content-length: %d\r\n\r\n%b" % (len(body), body)
    )


def test_a_refusal_at_the_head_pipelined_with_its_body_all_in_keeps_the_connection(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """Pipelined behind a slow request, a request refused at its head whose client asked
    for a 100 Continue but sent its body at once: at its turn the body is all in, so its
    400 leaves the connection open and the request after it is answered, on both paths.
    The ASGI relay took the body as still owed whatever had come (the wire asked
    `complete`): a 400 with `connection: close`, and the next request dropped."""

    async def slow(conn: Conn, request: Request) -> None:
        await asyncio.sleep(1.0)  # the requests behind it are all in before its answer
        conn.write(ok(b"slow"))
        await conn.drain()

    upstream.default = by_target({b"/v1/slow": slow}, SECOND)
    pipelined = get(b"/v1/slow") + refused_at_its_head_expecting_continue(b"{}") + get(b"/v1/x")
    with proxy(upstream.url) as base:
        got = exchange(base, pipelined, idle=1.5, total=10.0, done=whole(3))
    answers = responses(got)
    assert [status for status, _, _ in answers] == [200, 400, 200], got
    assert b"connection: close" not in answers[1][1].lower(), got
    assert answers[2][2] == b"second", got


def test_a_refusal_at_the_head_that_starts_before_its_body_is_in_closes_the_connection(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """The same request on a connection of its own: its turn comes at its head, before
    its body is read, so its 400 says the connection closes (the client may keep the body
    back for good), on both paths, though the body came in the same write."""
    request = refused_at_its_head_expecting_continue(b"{}") + get(b"/v1/x")
    with proxy(upstream.url) as base:
        got = exchange(base, request, idle=1.5, total=10.0)
    answers = responses(got)
    assert [status for status, _, _ in answers] == [400], got
    assert b"connection: close" in answers[0][1].lower(), got


def head_of(lines: int, size: int = 1000) -> bytes:
    """A 200 whose head has `lines` header lines of about `size` bytes (each line within
    every client's bound on a line), then a 2-byte body."""
    fields = b"".join(b"x-h%03d: %b\r\n" % (i, b"v" * size) for i in range(lines))
    return b"HTTP/1.1 200 OK\r\n" + fields + b"content-length: 2\r\n\r\nok"


@pytest.mark.parametrize(
    ("lines", "size", "status"),
    [(60, 1000, 200), (80, 1000, 502), (400, 1000, 502), (600, 1, 200)],
    ids=["60 KiB", "80 KiB", "400 KiB", "600 short lines"],
)
def test_a_response_head_is_bounded_alike_on_every_path(
    upstream: RawUpstream, path: DataPath, lines: int, size: int, status: int
) -> None:
    """One bound on a response head, 64 KiB of header lines (MAX_RESPONSE_HEAD): within
    it the response goes through, over it a 502 counted malformed, on the wire and on
    both ASGI transports. It was each data path's own: the wire's 64 KiB, aiohttp's
    none (a 400 KiB head went to the client whole, 64 KiB a line), httpcore's 100 KiB;
    and aiohttp took at most 512 lines, however short (a 6.5 KiB head of 600 was a 502)."""
    response = head_of(lines, size)

    async def big_head(conn: Conn, request: Request) -> None:
        conn.write(response)
        await conn.drain()

    upstream.default = by_target({b"/v1/big-head": big_head}, SECOND)
    with path.proxy(upstream.url) as base:
        got = exchange(base, get(b"/v1/big-head"), idle=1.0, total=10.0, done=whole())
        assert got.startswith(b"HTTP/1.1 %d" % status), got[:200]
        malformed = 0 if status == 200 else 1
        assert until(lambda: counted(base, ERRORS, kind="malformed") == malformed)
        next_got = exchange(base, get(b"/v1/next"), idle=1.0, done=whole())
        assert next_got.endswith(b"second"), next_got


def head_of_exactly(counted: int) -> tuple[bytes, bytes]:
    """A 200 whose header lines count exactly `counted` bytes (name, value and 4 each, as
    both data paths count them), split before its last CRLF: (the head but that CRLF,
    the CRLF and a 2-byte body)."""
    lines, used = [b"content-length: 2\r\n"], header_line_bytes(b"content-length", b"2")
    while counted - used > 1004:
        lines.append(b"x-h%04d: %b\r\n" % (len(lines), b"v" * (1004 - 11)))
        used += 1004
    rest = counted - used - header_line_bytes(b"x-last", b"")  # the last line's value
    lines.append(b"x-last: %b\r\n" % (b"v" * rest))
    return b"HTTP/1.1 200 OK\r\n" + b"".join(lines), b"\r\nok"


@pytest.mark.parametrize(
    ("shape", "status"),
    [("64 KiB split late", 200), ("a 103 of 40 KiB then 30 KiB", 200)],
)
def test_a_head_within_the_bound_goes_through_however_it_came(
    upstream: RawUpstream, path: DataPath, shape: str, status: int
) -> None:
    """The wire counted a head still coming by its raw reads, the status line and line
    ends included: a head of lines counting exactly 64 KiB went through in one write and
    was a 502 with its last line 0.3 s late, on the wire only. And a 103's lines counted
    against the final head's bound on the wire only: a 103 of 40 KiB then a 200 of 30 KiB
    was a 502 there, a 200 on the ASGI relay, whose clients drop the 1xx."""

    async def answer_(conn: Conn, request: Request) -> None:
        if shape.startswith("64"):
            head, rest = head_of_exactly(
                MAX_RESPONSE_HEAD - header_line_bytes(b"content-length", b"2")
            )
            conn.write(head)
            await conn.drain()
            await asyncio.sleep(0.3)
            conn.write(rest)
        else:
            hints = b"".join(b"link: </%b>\r\n" % (b"a" * 990) for _ in range(40))
            conn.write(b"HTTP/1.1 103 Early Hints\r\n" + hints + b"\r\n" + head_of(30)[:-2])
            conn.write(b"ok")
        await conn.drain()

    upstream.default = by_target({b"/v1/head": answer_}, SECOND)
    with path.proxy(upstream.url) as base:
        got = exchange(base, get(b"/v1/head"), idle=1.0, total=10.0, done=whole())
        assert got.startswith(b"HTTP/1.1 %d" % status), got[:200]
        assert got.endswith(b"ok"), got[-200:]
        assert counted(base, ERRORS, kind="malformed") == 0
