"""The WebSocket tunnel under hostile clients (issue 32, defects 2 and 3): nothing after the
upgrade head goes upstream before the 101, the handshake passes the same header policy as
HTTP, a bad target gets the HTTP relay's answer, and the upstream's base path is kept.

Only the wire tunnels WebSockets (the ASGI relay refuses them: test_client.py), so these
run on the wire alone.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager

import pytest

from tests.hostile.client import KEY, SWITCH, Switcher, header_names, responses, whole, ws_head
from tests.hostile.peers import Conn, RawUpstream, exchange
from tests.hostile.shared import counted, counted_when

Proxy = Callable[..., AbstractContextManager[str]]
FRAMES = b"\x81\x85\x00\x00\x00\x00hello"  # a masked text frame, "hello"


@pytest.fixture
def relay(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("TOKENPROBE_RELAY", "wire")
    return "wire"


def test_nothing_after_the_upgrade_head_goes_upstream_before_the_101(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """Frames written with the head wait for the upstream's 101; then they go."""
    switcher = Switcher(delay=0.5)
    upstream.default = switcher.script()
    with proxy(upstream.url) as base:
        got = exchange(base, ws_head() + FRAMES, idle=1.0)
        assert got.startswith(b"HTTP/1.1 101"), got
        assert upstream.wait_for(lambda: upstream.all_received().endswith(FRAMES), 5)
    (at_101,) = switcher.at_answer
    assert at_101.endswith(b"\r\n\r\n") and at_101.count(b"\r\n\r\n") == 1, at_101


def test_the_handshake_passes_the_http_header_policy(upstream: RawUpstream, proxy: Proxy) -> None:
    """Hop-by-hop headers, those Connection names, and Proxy-Authorization stop at the
    proxy on a handshake as on HTTP; the handshake's own headers pass as sent."""
    upstream.default = Switcher(delay=0.0).script()
    hop = (
        b"X-Hop: hop\r\nProxy-Authorization: Basic c2VjcmV0\r\nKeep-Alive: timeout=5\r\n"
        b"TE: trailers\r\nX-Kept: kept\r\nSec-WebSocket-Protocol: chat\r\n"
    )
    handshake = ws_head(extra=hop).replace(b"Connection: Upgrade", b"Connection: Upgrade, X-Hop")
    plain = (
        b"GET /v1/models HTTP/1.1\r\nHost: proxy.example\r\nConnection: X-Hop\r\n" + hop + b"\r\n"
    )
    with proxy(upstream.url) as base:
        assert exchange(base, handshake, idle=0.5, done=whole()).startswith(b"HTTP/1.1 101")
        assert exchange(base, plain, idle=0.5, done=whole()).startswith(b"HTTP/1.1 200")
    ws, http = upstream.requests
    assert ws.header(b"sec-websocket-key") == [KEY]
    assert ws.header(b"sec-websocket-version") == [b"13"]
    assert ws.header(b"sec-websocket-protocol") == [b"chat"]
    assert ws.header(b"upgrade") == [b"websocket"]
    assert b"upgrade" in ws.header(b"connection")[0].lower()
    assert ws.header(b"x-kept") == [b"kept"]
    assert ws.header(b"host") == [f"127.0.0.1:{upstream.port}".encode()]
    for name in (b"x-hop", b"proxy-authorization", b"keep-alive", b"te"):
        assert ws.header(name) == [] and http.header(name) == [], name

    # One policy: the same client headers survive both, bar the handshake's own.
    def end_to_end(head: bytes) -> set[bytes]:
        own = {b"upgrade", b"connection"}
        return {n for n in header_names(head) - own if not n.startswith(b"sec-websocket-")}

    # the proxy's own: the client's address last in X-Forwarded-For, on both
    assert end_to_end(ws.head) == end_to_end(http.head) == {b"host", b"x-kept", b"x-forwarded-for"}
    assert ws.header(b"x-forwarded-for") == http.header(b"x-forwarded-for") == [b"127.0.0.1"]


def test_a_bad_target_gets_the_http_relays_answer(upstream: RawUpstream, proxy: Proxy) -> None:
    upstream.default = Switcher().script()
    with proxy(upstream.url) as base:
        got = exchange(base, ws_head(b"/v1/a%2Fb"), idle=1.0, done=whole())
        plain = exchange(base, b"GET /v1/a%2Fb HTTP/1.1\r\nHost: x\r\n\r\n", idle=1.0, done=whole())
    ((status, _, body),) = responses(got)
    ((plain_status, _, plain_body),) = responses(plain)
    assert status == plain_status == 400
    assert b"invalid_request_target" in body and body == plain_body
    assert upstream.all_received() == b""


def test_the_tunnel_keeps_the_upstreams_base_path(upstream: RawUpstream, proxy: Proxy) -> None:
    upstream.default = Switcher(delay=0.0).script()
    with proxy(upstream.url + "/tenant-a") as base:
        got = exchange(base, ws_head(b"/v1/realtime?model=m"), idle=0.5, done=whole())
    assert got.startswith(b"HTTP/1.1 101"), got
    (seen,) = upstream.requests
    assert seen.target == b"/tenant-a/v1/realtime?model=m"


def test_the_handshakes_target_is_read_as_the_http_relay_reads_it(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """An absolute form (RFC 9112 §3.2.2: a server must accept it) and a fragment: the
    HTTP relay forwards `/v1/models?x=1` for both; the tunnel once split the raw target
    itself, refusing the first (400) and sending the second as `%23frag`, unmeasured."""
    upstream.default = Switcher(delay=0.0).script()
    targets = [b"http://proxy.example/v1/realtime?x=1", b"/v1/realtime?x=1#frag"]
    with proxy(upstream.url) as base:
        for target in targets:
            got = exchange(base, ws_head(target), idle=0.5, done=whole())
            assert got.startswith(b"HTTP/1.1 101"), (target, got)
    assert [r.target for r in upstream.requests] == [b"/v1/realtime?x=1"] * 2


def _never_answers(closed_after: list[float]) -> Callable[[Conn], Awaitable[None]]:
    """An upstream that reads the handshake and answers nothing, noting how long after it
    the proxy closed the connection."""

    async def script(conn: Conn) -> None:
        if await conn.read_request() is None:
            return
        started = time.monotonic()
        if await conn.wait_closed_by_peer(timeout=8.0):
            closed_after.append(time.monotonic() - started)

    return script


def test_a_client_that_leaves_before_the_101_closes_the_upstream_connection(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """While the proxy holds the client's bytes for the upstream's 101 it reads the client
    on, so its close is seen and the upstream connection closed at once (as on HTTP). With
    its reading paused the close went unseen until the upstream answered or the idle
    timeout (300 s by default) ended the session."""
    closed_after: list[float] = []
    upstream.default = _never_answers(closed_after)
    with proxy(upstream.url, "--ws-idle-timeout", "30") as base:
        host, port = base.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(ws_head() + FRAMES)
            assert upstream.wait_for(lambda: len(upstream.requests) == 1, 5)
            time.sleep(0.2)
        assert upstream.wait_for(lambda: bool(closed_after), 9), "the upstream waited on"
    assert closed_after[0] < 2.0, closed_after


def test_a_handshake_never_answered_gets_a_504_at_the_first_byte_timeout(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """An upstream that takes the handshake and answers nothing: the client gets the 504 an
    HTTP request gets at --first-byte-timeout, and the session ends as upstream_timeout.
    It once waited for --ws-idle-timeout and got a bare close, counted idle_timeout."""
    closed_after: list[float] = []
    upstream.default = _never_answers(closed_after)
    flags = ("--first-byte-timeout", "1", "--ws-idle-timeout", "30")
    with proxy(upstream.url, *flags) as base:
        started = time.monotonic()
        got = exchange(base, ws_head(), idle=5.0)
        answered_after = time.monotonic() - started
        sessions = counted_when(
            base, "tokenprobe_websocket_sessions_total", 1, outcome="upstream_timeout"
        )
    ((status, _, body),) = responses(got)
    assert status == 504 and b"upstream_timeout" in body, got
    assert 1.0 <= answered_after < 4.0, answered_after
    assert closed_after and closed_after[0] < 3.0, closed_after
    assert sessions("tokenprobe_websocket_sessions_total") == 1


def test_a_close_frame_in_the_101s_read_is_the_upstreams_first_close(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """An upstream that switches and closes at once (its 101 and its close frame in one
    write, so one read): it began the closing handshake (RFC 6455 §7.1.2), and the session
    ends closed_by_upstream. The frames after the 101 went to the bounds but not to the
    first-close check, so the client's answer was taken for the first close."""
    upstream.default = Switcher(answer=SWITCH + b"\x88\x02\x03\xe8", delay=0.0).script()
    answer = b"\x88\x82\x00\x00\x00\x00\x03\xe8"  # the client's close, masked (zero key)
    with proxy(upstream.url) as base:
        got = exchange(base, ws_head(b"/v1/other"), then=answer, after=0.3, idle=1.0)
        sessions = counted_when(
            base, "tokenprobe_websocket_sessions_total", 1, outcome="closed_by_upstream"
        )
        by_client = counted(base, "tokenprobe_websocket_sessions_total", outcome="closed_by_client")
    assert got.startswith(b"HTTP/1.1 101 ") and got.endswith(b"\x88\x02\x03\xe8"), got
    assert sessions("tokenprobe_websocket_sessions_total") == 1
    assert by_client == 0


def test_a_refused_upgrades_redirect_into_the_upstream_points_at_the_proxy(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """As on HTTP (nginx's proxy_redirect default): a refusal that redirects into the
    upstream's URL names the proxy as the client named it, not the backend's address,
    which a client may not reach and which would take it around the proxy."""
    own = f"http://127.0.0.1:{upstream.port}".encode()
    refusal = b"HTTP/1.1 302 Found\r\nLocation: " + own + b"/v1/other\r\ncontent-length: 0\r\n\r\n"
    upstream.default = Switcher(answer=refusal, delay=0.0).script()
    with proxy(upstream.url) as base:
        got = exchange(base, ws_head(b"/v1/realtime"), idle=2.0)
    located = refusal.replace(own, b"http://proxy.example")  # ws_head's Host
    assert got == located.replace(b"302 Found\r\n", b"302 Found\r\nconnection: close\r\n"), got


def test_a_refused_upgrade_closes_the_client_connection(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """A refusal (here a 403 the upstream would keep alive) is relayed as sent, and the
    connection then closes: it never becomes a pipe."""
    upstream.default = Switcher(
        answer=b"HTTP/1.1 403 Forbidden\r\ncontent-length: 2\r\n\r\nno", delay=0.0
    ).script()
    with proxy(upstream.url) as base:
        start = time.monotonic()
        got = exchange(base, ws_head(), idle=5.0)
        took = time.monotonic() - start
    # the proxy closes the connection after a refusal, and says so
    assert got == b"HTTP/1.1 403 Forbidden\r\nconnection: close\r\ncontent-length: 2\r\n\r\nno"
    assert took < 4.0  # closed by the proxy, not by the idle wait
