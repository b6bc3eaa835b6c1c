"""Two more ways a misbehaving upstream reached a client through one data path and not
another (a hostile-peer review): late stray bytes on a pooled connection, and chunk
framing that h11 waits on.

1. HTTP/1.1 cannot tell bytes an upstream sends late, after the proxy wrote the next
   request on a reused connection, from that request's answer: the next client gets
   them, on whichever data path (the guard of test_upstream.py closes a connection only
   when the bytes come while it sits idle). The answers that by their nature invite a
   broken server to send a body (a HEAD's, a 204, a 304, one after a 1xx) are rare in
   LLM traffic, so their connection is closed after the answer, never pooled, on every
   path; any other answer's connection is still reused.
2. A chunk size line ended by a bare LF (`2\\nok\\n0\\n\\n`), on a connection the upstream
   keeps open: llhttp and aiohttp refuse it at once, h11 waited for a CRLF that never
   came, the client holding a 200 head until --idle-timeout (300 s by default). Now the
   httpx transport breaks at once too, counted `malformed` as the wire counts it.

Each test runs on the wire and on both ASGI transports (the `path` fixture), in a real
`tokenprobe serve` in front of a `RawUpstream` (conftest.py). Shown able to fail: each was
run against the tree before the fix (docs/hostile-peers.md).
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from tests.hostile.client import whole
from tests.hostile.peers import Conn, Handler, RawUpstream, Request, by_target, exchange, get, ok
from tests.hostile.shared import DataPath, counted, until

ERRORS = "tokenprobe_upstream_protocol_errors_total"
REQUESTS = "tokenprobe_requests_total"
SECOND = ok(b"second")
#: What a broken upstream writes late, as if it were a body: a whole response, which the
#: next request on the connection would read as its own answer.
LATE = ok(b"LEAKED")


# -- 1. late stray bytes ---------------------------------------------------------------------


def then_stray_bytes(answer: bytes, closed: list[bool]) -> Handler:
    """A handler writing `answer`, then waiting for the next request on its connection:
    none (the proxy closed it) is noted True in `closed`; one gets `LATE`, the bytes a
    broken server sends late, which reach whichever request the connection then carries
    (the worst case of the race, made certain)."""

    async def handler(conn: Conn, request: Request) -> None:
        conn.write(answer)
        await conn.drain()
        after = await conn.read_request(timeout=10)
        closed.append(after is None)
        if after is not None:
            conn.write(LATE)
            await conn.drain()

    return handler


INVITING = {
    "HEAD": (
        b"HEAD /v1/odd HTTP/1.1\r\nHost: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 49\r\n\r\n",
    ),
    "204": (get(b"/v1/odd"), b"HTTP/1.1 204 No Content\r\n\r\n"),
    "304": (get(b"/v1/odd"), b'HTTP/1.1 304 Not Modified\r\netag: "x"\r\n\r\n'),
    "103 then 200": (
        get(b"/v1/odd"),
        b"HTTP/1.1 103 Early Hints\r\nlink: </a.css>\r\n\r\n" + ok(b"first"),
    ),
}


@pytest.mark.parametrize("case", list(INVITING))
def test_an_answer_that_invites_a_stray_body_is_not_followed_on_its_connection(
    upstream: RawUpstream, path: DataPath, case: str
) -> None:
    """Client A's answer invites a broken server's body (a HEAD's, a 204, a 304, one after
    a 1xx); client B, on a connection of its own, asks next. The upstream sends stray bytes
    on A's connection once a next request is on it: B got them, `LEAKED`, on the wire and
    the httpx transport (aiohttp, by the order of its pool, only sometimes). Now A's
    upstream connection is closed after its answer, and B's request goes on a new one."""
    request, answer = INVITING[case]
    closed: list[bool] = []
    upstream.default = by_target({b"/v1/odd": then_stray_bytes(answer, closed)}, SECOND)
    with path.proxy(upstream.url) as base:
        first = exchange(base, request, idle=0.5, done=whole(bodiless=case == "HEAD"))
        second = exchange(base, get(b"/v1/next"), idle=1.0, done=whole())
        assert first.startswith(b"HTTP/1.1 "), first
        assert b"LEAKED" not in second, second
        assert second.startswith(b"HTTP/1.1 200 ") and second.endswith(b"second"), second
        assert upstream.wait_for(lambda: bool(closed), 10)
        for kind in ("extra_bytes", "idle_bytes", "malformed"):
            assert counted(base, ERRORS, kind=kind) == 0, kind  # a close, no error
    assert closed == [True]  # the proxy closed A's upstream connection after its answer
    assert [r.target for r in upstream.requests] == [b"/v1/odd", b"/v1/next"]
    assert upstream.connections == 2


def test_an_ordinary_answers_connection_is_still_reused(
    upstream: RawUpstream, path: DataPath
) -> None:
    """The close above is for those answers alone: after a 200 with a body the next
    client's request goes on the same upstream connection."""
    upstream.default = by_target({}, SECOND)
    with path.proxy(upstream.url) as base:
        for _ in range(2):
            got = exchange(base, get(b"/v1/next"), idle=0.5)
            assert got.endswith(b"second"), got
            time.sleep(0.05)  # the connection settles back into the pool
    assert upstream.connections == 1


# -- 2. chunk framing the parser refuses, on a connection kept open --------------------------

STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
BAD_FRAMING = {"not hex": b"zz\r\nnot a chunk\r\n", "bare LF": b"2\nok\n0\n\n"}
CHAT = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
CHAT_REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(CHAT), CHAT)
)


def bad_framing_kept_open(framing: bytes, *, same_write: bool) -> Handler:
    """A handler writing a chunked head and `framing`, in the same write or 0.1 s apart,
    then keeping the connection open, silent (until the test's hang-up)."""

    async def handler(conn: Conn, request: Request) -> None:
        if same_write:
            conn.write(STREAM_HEAD + framing)
        else:
            conn.write(STREAM_HEAD)
            await conn.drain()
            await asyncio.sleep(0.1)
            conn.write(framing)
        await conn.drain()
        await asyncio.sleep(60)

    return handler


def until_answered(base: str, request: bytes, limit: float) -> tuple[bytes, bool, float]:
    """Everything the proxy sent for `request` on a new connection until it closed it, or
    its answer was whole (a Content-Length body all in), or `limit` seconds passed:
    (the bytes, whether it closed, the seconds it took)."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    got = bytearray()
    closed = False
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=limit) as sock:
        sock.sendall(request)
        while not _whole(bytes(got)) and (left := limit - (time.monotonic() - start)) > 0:
            sock.settimeout(left)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            except ConnectionError:
                closed = True
                break
            if not chunk:
                closed = True
                break
            got += chunk
    return bytes(got), closed, time.monotonic() - start


def _whole(data: bytes) -> bool:
    head, sep, body = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if sep and name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False


@pytest.mark.parametrize("same_write", [True, False], ids=["with the head", "after it"])
@pytest.mark.parametrize("framing", list(BAD_FRAMING))
def test_chunk_framing_the_parser_refuses_breaks_the_answer_at_once(
    upstream: RawUpstream, path: DataPath, framing: str, same_write: bool
) -> None:
    """A chunk size that is not hex, or chunk lines ended by a bare LF (RFC 9112 §7.1
    wants CRLF; llhttp and aiohttp refuse it), on a connection the upstream keeps open:
    the client's answer breaks at once, as docs/reliability.md says, and the upstream is
    counted `malformed` once. The relayed 200 head then a dropped connection, recorded
    stream_truncated; or, on aiohttp, whose parser refuses the whole read before it hands
    on the head, when the framing came in the head's read, the proxy's 502 (upstream_error).
    The httpx transport waited for a CRLF after a bare LF until --idle-timeout (recorded
    upstream_timeout), and counted neither case `malformed`."""
    handler = bad_framing_kept_open(BAD_FRAMING[framing], same_write=same_write)
    upstream.default = by_target({b"/v1/chat/completions": handler})
    with path.proxy(upstream.url) as base:
        got, closed, seconds = until_answered(base, CHAT_REQUEST, limit=20.0)
        assert seconds < 10.0, (seconds, got)  # the idle timeout is 300 s
        if got.startswith(b"HTTP/1.1 502 ") and path.name == "asgi":
            error_type = "upstream_error"
        else:
            assert got.startswith(b"HTTP/1.1 200 "), got
            assert closed, got  # dropped, not held open
            assert not got.endswith(b"0\r\n\r\n"), got  # no last chunk: a client sees it cut
            error_type = "stream_truncated"
        assert until(lambda: counted(base, REQUESTS, error_type=error_type) == 1)
        assert until(lambda: counted(base, ERRORS, kind="malformed") == 1)
        assert counted(base, REQUESTS, error_type="upstream_timeout") == 0
