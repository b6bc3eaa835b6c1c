"""How a response's framing reaches the client, on both data paths: the upstream's
transfer codings (only `chunked` alone is taken, proxy/server/protocol.py
`refused_transfer_encoding`, all Transfer-Encoding lines together), and an HTTP/1.0 client, which gets a body of no known length
unframed, its end the close (`UnframedCycle` on the ASGI relay; the wire frames by the
client's version).

Each test runs on both data paths (conftest.py), in a real `tokenprobe serve` in front of
a `RawUpstream`. Shown able to fail: each was run against the tree before the fix."""

from __future__ import annotations

import gzip
import socket
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import pytest

from tests.hostile.client import header_names, responses
from tests.hostile.peers import SSE_BODY, Conn, RawUpstream, Request, by_target, get, ok
from tests.hostile.shared import counted, until

Proxy = Callable[..., AbstractContextManager[str]]
MALFORMED = {"kind": "malformed"}
ERRORS = "tokenprobe_upstream_protocol_errors_total"
PASSTHROUGH = "tokenprobe_passthrough_requests_total"
CODED = gzip.compress(b'{"coded": true}')


def get_once(target: bytes) -> bytes:
    """A GET for `target` that asks the proxy to close the connection after its answer."""
    return get(target)[:-2] + b"connection: close\r\n\r\n"


def to_the_close(base: str, request: bytes, timeout: float = 10.0) -> tuple[bytes, bool]:
    """Write `request` on a new connection and read until the proxy closes it: every
    byte received, and whether the close came (False: `timeout` passed first)."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    got = bytearray()
    deadline = time.monotonic() + timeout
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(request)
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                data = sock.recv(65536)
            except TimeoutError:
                break
            if not data:
                return bytes(got), True
            got += data
    return bytes(got), False


# -- the upstream's transfer codings ----------------------------------------------------------


ONLY_CHUNKED = b"only chunked is taken"  # refused_transfer_encoding's words


@pytest.mark.parametrize(
    ("codings", "said"),
    [
        (b"transfer-encoding: gzip\r\n", ONLY_CHUNKED),
        (b"transfer-encoding: GZIP \r\n", ONLY_CHUNKED),
        (b"transfer-encoding: chunked, gzip\r\n", ONLY_CHUNKED),
        (b"transfer-encoding: identity\r\n", ONLY_CHUNKED),
        # with a length too: the parsers' own refusal, before the rule, as for `chunked`
        (b"transfer-encoding: gzip\r\ncontent-length: 35\r\n", b"can't be present with"),
    ],
    ids=["gzip", "gzip-upper", "chunked-gzip", "identity", "gzip-and-length"],
)
def test_a_transfer_coding_that_frames_nothing_is_a_502(
    upstream: RawUpstream, proxy: Proxy, codings: bytes, said: bytes
) -> None:
    """A last coding other than chunked frames nothing (RFC 9112 §6.3, item 4): the body
    runs to the close, still coded. Both paths relayed those bytes in a 200 with nothing
    to say they were coded (a Transfer-Encoding is hop by hop, and the proxy asked for
    none). Now a malformed response, as nginx refuses every coding but chunked: a 502,
    counted, nothing of the body relayed, and the next request gets its own answer."""

    async def coded_to_the_close(conn: Conn, request: Request) -> None:
        conn.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + codings + b"\r\n")
        conn.write(CODED)
        await conn.drain()
        conn.writer.close()

    upstream.default = by_target({b"/v1/coded": coded_to_the_close}, ok(b"second"))
    with proxy(upstream.url) as base:
        got, _ = to_the_close(base, get_once(b"/v1/coded"))
        assert got.startswith(b"HTTP/1.1 502"), got
        assert CODED not in got and CODED[:4] not in got
        assert said in got, got
        assert until(lambda: counted(base, ERRORS, **MALFORMED) == 1)
        assert until(lambda: counted(base, PASSTHROUGH, code="502") == 1)
        two, _ = to_the_close(base, get_once(b"/v1/other"))
        assert [(status, body) for status, _, body in responses(two)] == [(200, b"second")]


@pytest.mark.parametrize(
    "coding",
    [b"chunked", b"Chunked", b"CHUNKED ", b" chunked"],
    ids=["lower", "title", "upper", "space"],
)
def test_chunked_alone_in_any_case_is_taken(
    upstream: RawUpstream, proxy: Proxy, coding: bytes
) -> None:
    """The one coding taken, whatever its case and spaces (a coding's name is
    case-insensitive, RFC 9112 §7): relayed, nothing counted."""
    response = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: "
        + coding
        + b"\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    )

    async def chunked(conn: Conn, request: Request) -> None:
        conn.write(response)
        await conn.drain()

    upstream.default = by_target({b"/v1/chunked": chunked})
    with proxy(upstream.url) as base:
        got, _ = to_the_close(base, get_once(b"/v1/chunked"))
        assert [(status, body) for status, _, body in responses(got)] == [(200, b"hello")], got
        assert counted(base, ERRORS, **MALFORMED) == 0


@pytest.mark.parametrize(
    "codings",
    [
        b"transfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n",
        b"transfer-encoding: chunked, chunked\r\n",
        b"transfer-encoding: Chunked\r\ntransfer-encoding: chunked\r\n",
    ],
    ids=["two-lines", "one-line", "two-lines-title"],
)
def test_a_second_chunked_is_a_502_on_a_line_of_its_own_too(
    upstream: RawUpstream, proxy: Proxy, codings: bytes
) -> None:
    """A second `chunked` codes the chunks once more (RFC 9112 §6.1 forbids it): both
    paths de-chunk once and would relay the body still coded by the second, unlabelled. Two lines
    are one list of codings (RFC 9110 §5.3), so the lines are judged together, as the
    request side judges them: each line alone was checked, and two lines `chunked` were
    relayed in a 200 while `chunked, chunked` on one line was a 502."""

    async def chunked_twice(conn: Conn, request: Request) -> None:
        conn.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n" + codings + b"\r\n")
        conn.write(b"5\r\nhello\r\n0\r\n\r\n")
        await conn.drain()

    upstream.default = by_target({b"/v1/twice": chunked_twice}, ok(b"second"))
    with proxy(upstream.url) as base:
        got, _ = to_the_close(base, get_once(b"/v1/twice"))
        assert got.startswith(b"HTTP/1.1 502"), got
        assert b"hello" not in got and ONLY_CHUNKED in got, got
        assert until(lambda: counted(base, ERRORS, **MALFORMED) == 1)
        two, _ = to_the_close(base, get_once(b"/v1/other"))
        assert [(status, body) for status, _, body in responses(two)] == [(200, b"second")]


# -- an HTTP/1.0 client -----------------------------------------------------------------------

STREAM = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
CHAT = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
COMPLETION = (
    b'{"id":"c","object":"chat.completion","model":"m","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"Hello"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}'
)


def post_1_0(body: bytes) -> bytes:
    """A chat request as an HTTP/1.0 client writes it: no Host, its body's length."""
    return (
        b"POST /v1/chat/completions HTTP/1.0\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%b" % (len(body), body)
    )


async def like_vllm(conn: Conn, request: Request) -> None:
    """vLLM's answers: a stream in chunks (no length), a completion with its length."""
    if b'"stream":true' in request.body:
        conn.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        for event in SSE_BODY.split(b"\n\n")[:-1]:
            conn.write(b"%x\r\n%b\n\n\r\n" % (len(event) + 2, event))
            await conn.drain()
        conn.write(b"0\r\n\r\n")
    else:
        conn.write(ok(COMPLETION))
    await conn.drain()


def test_an_http_1_0_client_gets_a_stream_unframed_and_closed_at_its_end(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """An HTTP/1.0 client cannot read chunks (RFC 9112 §6.1: no Transfer-Encoding in
    answer to one). The ASGI relay sent the stream in chunks, as uvicorn frames any
    response with no length whatever the client's version; the client took the chunk
    sizes for the stream's bytes. Now, as the wire, nginx and h11: no framing, and the
    connection closes at the stream's end."""
    upstream.default = by_target({b"/v1/chat/completions": like_vllm})
    with proxy(upstream.url) as base:
        got, closed = to_the_close(base, post_1_0(STREAM))
    assert closed, got
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"transfer-encoding" not in header_names(head), head
    assert b"content-length" not in header_names(head), head
    assert b"connection: close" in head.lower(), head
    assert body == SSE_BODY, body


def test_an_http_1_0_client_gets_a_completion_by_its_length(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    upstream.default = by_target({b"/v1/chat/completions": like_vllm})
    with proxy(upstream.url) as base:
        got, closed = to_the_close(base, post_1_0(CHAT))
    assert closed, got
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"transfer-encoding" not in header_names(head), head
    assert b"content-length: %d" % len(COMPLETION) in head.lower(), head
    assert body == COMPLETION, body
