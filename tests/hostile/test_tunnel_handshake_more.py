"""The upstream's answer to a WebSocket handshake, judged as the HTTP relay judges an
answer: a head llhttp refuses gets the client the HTTP relay's 502 in its words (counted
malformed), and interim (1xx) heads do not keep a handshake past --first-byte-timeout.
Both once held the client until --ws-idle-timeout (300 s by default).

Only the wire tunnels WebSockets (the ASGI relay refuses them: test_client.py), so these
run on the wire alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import pytest

from tests.hostile.client import Switcher, responses, whole, ws_head
from tests.hostile.peers import Conn, RawUpstream, exchange
from tests.hostile.shared import counted_when

Proxy = Callable[..., AbstractContextManager[str]]
#: A head llhttp refuses ("Invalid character in Content-Length").
BAD_HEAD = b"HTTP/1.1 200 OK\r\nContent-Length: zz\r\n\r\n"
SLOW = ("--ws-idle-timeout", "30")  # an idle wait no test here may meet


@pytest.fixture
def relay(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("TOKENPROBE_RELAY", "wire")
    return "wire"


def test_a_handshake_answered_with_a_head_llhttp_refuses_gets_the_http_relays_502(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """The same malformed head answering a handshake and a plain GET: both clients get the
    502 "malformed response: ..." at once, both are counted malformed, and the session
    ends as error. The handshake's client got the head itself, held until the idle
    timeout, and nothing was counted."""
    upstream.default = Switcher(answer=BAD_HEAD, delay=0.0, plain=BAD_HEAD).script()
    with proxy(upstream.url, *SLOW) as base:
        started = time.monotonic()
        got = exchange(base, ws_head(b"/v1/other"), idle=5.0)
        answered_after = time.monotonic() - started
        plain = exchange(
            base, b"GET /v1/other HTTP/1.1\r\nHost: proxy.example\r\n\r\n", idle=5.0, done=whole()
        )
        change = counted_when(
            base, "tokenprobe_upstream_protocol_errors_total", 2, kind="malformed"
        )
        sessions = counted_when(
            base, "tokenprobe_websocket_sessions_total", 1, outcome="upstream_error"
        )
    assert got.startswith(b"HTTP/1.1 502 "), got  # not the upstream's head
    ((status, _, body),) = responses(got)
    assert b"malformed response: Invalid character in Content-Length" in body, got
    assert responses(plain) == [(status, responses(plain)[0][1], body)], (got, plain)
    assert answered_after < 4.0, answered_after
    assert change("tokenprobe_upstream_protocol_errors_total") == 2
    assert sessions("tokenprobe_websocket_sessions_total") == 1


def test_a_refusal_whose_body_llhttp_refuses_ends_both_connections(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """A refusal's head is good and went to the client; its chunked body is not (a chunk
    size that is not hex): too late for the proxy's 502, so the client has what came and
    both connections close at once, counted malformed, as the wire closes such an HTTP
    response. It waited for the idle timeout."""
    refusal = b"HTTP/1.1 403 Forbidden\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"
    upstream.default = Switcher(answer=refusal, delay=0.0).script()
    with proxy(upstream.url, *SLOW) as base:
        started = time.monotonic()
        got = exchange(base, ws_head(b"/v1/other"), idle=5.0)
        closed_after = time.monotonic() - started
        change = counted_when(
            base, "tokenprobe_upstream_protocol_errors_total", 1, kind="malformed"
        )
        sessions = counted_when(
            base, "tokenprobe_websocket_sessions_total", 1, outcome="upstream_error"
        )
    # its head, saying the connection closes; not the chunk size llhttp refused
    assert (
        got == b"HTTP/1.1 403 Forbidden\r\nconnection: close\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    assert closed_after < 4.0, closed_after
    assert change("tokenprobe_upstream_protocol_errors_total") == 1
    assert sessions("tokenprobe_websocket_sessions_total") == 1


async def _processing_then_ok(conn: Conn) -> None:
    """`102 Processing` every 0.5 s for 6 s, then a 200: an upstream that is never done."""
    if await conn.read_request() is None:
        return
    try:
        for _ in range(12):
            conn.write(b"HTTP/1.1 102 Processing\r\n\r\n")
            await conn.drain()
            await asyncio.sleep(0.5)
        conn.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await conn.drain()
    except ConnectionError:
        return  # the proxy gave up on it


def test_interim_heads_do_not_keep_a_handshake_past_the_first_byte_timeout(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """1xx heads go to the client as they come, but no final answer within
    --first-byte-timeout gets it the proxy's 504 after them, as an HTTP request gets its
    504 (valid HTTP/1.1 after 1xx heads), and the session ends upstream_timeout. Each
    102 once counted as the answer's first byte, and the client waited the 6 s."""
    upstream.default = _processing_then_ok
    with proxy(upstream.url, "--first-byte-timeout", "1", *SLOW) as base:
        started = time.monotonic()
        got = exchange(base, ws_head(b"/v1/other"), idle=5.0)
        answered_after = time.monotonic() - started
        sessions = counted_when(
            base, "tokenprobe_websocket_sessions_total", 1, outcome="upstream_timeout"
        )
    *interim, (status, _, body) = responses(got)
    assert status == 504, got
    assert b"no response within 1 s (--first-byte-timeout)" in body, got
    assert interim and all(code == 102 for code, _, _ in interim), got
    assert 1.0 <= answered_after < 4.0, answered_after
    assert sessions("tokenprobe_websocket_sessions_total") == 1
