"""Three more places where the same upstream bytes gave the client a different answer
through the wire and through the ASGI relay (on one of its transports), each now decided
once: a 304's Content-Length, a response followed in its read by bytes no request asked
for, and a 1xx then the close on a reused connection.

Each test runs on the wire and on both ASGI transports, in a real `tokenprobe serve` in
front of a `RawUpstream` (conftest.py). Shown able to fail: each was run against the tree
before the fix (docs/hostile-peers.md).
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable

import pytest

from tests.hostile.client import header_names, responses, whole
from tests.hostile.peers import Conn, RawUpstream, Request, by_target, exchange, get, ok
from tests.hostile.shared import DataPath, counted, until

ERRORS = "tokenprobe_upstream_protocol_errors_total"
SECOND = ok(b"second")


Handler = Callable[[Conn, Request], Awaitable[None]]


def answer(response: bytes, on: list[int], *, then_close: bool = False) -> Handler:
    """A handler writing `response` in one write (then closing, if asked), noting in `on`
    the index of each connection it answered on."""

    async def handler(conn: Conn, request: Request) -> None:
        on.append(conn.index)
        conn.write(response)
        await conn.drain()
        if then_close:
            conn.writer.close()

    return handler


def one_by_one(base: str, requests: list[bytes]) -> list[bytes]:
    """Each request on one client connection, the next sent once the answer before it is
    in (quiet for 0.5 s after its first byte): every byte that came for each."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    answers = []
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        for request in requests:
            sock.sendall(request)
            got = bytearray()
            sock.settimeout(10)
            while True:
                try:
                    chunk = sock.recv(65536)
                except TimeoutError:
                    break
                if not chunk:
                    break
                got += chunk
                sock.settimeout(0.5)
            answers.append(bytes(got))
    return answers


def test_a_304s_content_length_goes_to_the_client_as_it_came(
    upstream: RawUpstream, path: DataPath
) -> None:
    """A 304's Content-Length is its selected representation's (RFC 9110 §8.6), relayed
    as the backend sent it, with no body, and the connection serves the next request. The
    wire relayed it; the ASGI relay dropped it (uvicorn took it for a body to come)."""
    not_modified = b'HTTP/1.1 304 Not Modified\r\netag: "x"\r\ncontent-length: 1234\r\n\r\n'
    upstream.default = by_target({b"/v1/same": answer(not_modified, [])}, SECOND)
    with path.proxy(upstream.url) as base:
        first, second = one_by_one(base, [get(b"/v1/same"), get(b"/v1/next")])
    assert first.startswith(b"HTTP/1.1 304 "), first
    assert first.endswith(b"\r\n\r\n"), first  # its head, and nothing after it
    assert b"content-length: 1234\r\n" in first.lower(), first
    assert b"transfer-encoding" not in header_names(first), first
    assert second.startswith(b"HTTP/1.1 200 ") and second.endswith(b"second"), second


HEAD = b"HEAD /v1/h HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.parametrize(
    ("request_", "response", "status", "body"),
    [
        (HEAD, b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", 200, b""),
        (get(b"/v1/h"), b"HTTP/1.1 304 Not Modified\r\ncontent-length: 2\r\n\r\nok", 304, b""),
        (get(b"/v1/h"), b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokGARBAGE", 200, b"ok"),
    ],
    ids=["HEAD with a body", "304 with a body", "bytes past Content-Length"],
)
def test_bytes_past_a_whole_response_in_its_read_leave_the_response_whole(
    upstream: RawUpstream,
    path: DataPath,
    request_: bytes,
    response: bytes,
    status: int,
    body: bytes,
) -> None:
    """A misbehaving upstream writes bytes past the end of a whole response, in the same
    write: a HEAD's or a 304's body, or more than its Content-Length. On the wire and
    httpx the response goes to the client, the bytes after it nowhere, and the connection
    closes, counted `extra_bytes`. On aiohttp, left as it is (docs/hostile-peers.md): its
    parser refuses the whole read at the first byte no response starts with, so the
    client gets a 502, counted malformed; the connection closes either way."""
    misbehaved: list[int] = []
    after: list[int] = []
    upstream.default = by_target(
        {b"/v1/h": answer(response, misbehaved), b"/v1/next": answer(SECOND, after)}
    )
    with path.proxy(upstream.url) as base:
        got = exchange(base, request_, idle=1.0, total=10.0, done=whole(bodiless=request_ is HEAD))
        if path.name == "asgi":
            assert got.startswith(b"HTTP/1.1 502 "), got
            assert until(lambda: counted(base, ERRORS, kind="malformed") == 1)
        else:
            assert got.startswith(b"HTTP/1.1 %d " % status), got
            assert got.endswith(b"\r\n\r\n" + body), got  # the stray bytes nowhere
            if request_ is not HEAD:
                [(_, _, relayed)] = responses(got)
                assert relayed == body, got
            assert until(lambda: counted(base, ERRORS, kind="extra_bytes") == 1)
            assert counted(base, ERRORS, kind="malformed") == 0
        next_got = exchange(base, get(b"/v1/next"), idle=1.0, done=whole())
        assert next_got.endswith(b"second"), next_got
    assert len(misbehaved) == len(after) == 1
    assert misbehaved != after  # the connection that misbehaved was not reused


def test_a_1xx_then_the_close_on_a_reused_connection_is_not_sent_again(
    upstream: RawUpstream, path: DataPath
) -> None:
    """A request on a kept-alive upstream connection gets a 103 Early Hints, then the
    connection closes. A 1xx is an answer (RFC 9110 §15.2: the backend took the request
    and is on its way to completing it), so the request is not sent again: a 502, once,
    on every path, as a close after any byte of the answer is. The httpx transport sent
    it again (h11 keeps no trace of a 1xx): a second run of a request the backend took."""
    hints = b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"
    first_on: list[int] = []
    hinted_on: list[int] = []
    upstream.default = by_target(
        {
            b"/v1/first": answer(SECOND, first_on),
            b"/v1/hinted": answer(hints, hinted_on, then_close=True),
        }
    )
    with path.proxy(upstream.url) as base:
        first, hinted = one_by_one(base, [get(b"/v1/first"), get(b"/v1/hinted")])
    assert first.endswith(b"second"), first
    assert hinted_on == first_on  # the request went on the reused connection, and only once
    assert hinted.startswith(b"HTTP/1.1 502 "), hinted
