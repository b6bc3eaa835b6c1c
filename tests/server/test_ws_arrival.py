"""A WebSocket session is timed as an HTTP request is: from its head's arrival, with the
upstream's first byte due within --first-byte-timeout of its going upstream, connect
included.

A handshake pipelined behind a slow response waits its turn unread; its session's duration
still counts from its arrival (the metric's help says so), as a pipelined POST's e2e does.
An upstream slow to accept (its accept queue full: the kernel drops the proxy's SYN) gets
the client the proxy's 504 at --first-byte-timeout, as an HTTP request to it does, not
after --connect-timeout and then --first-byte-timeout again.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

import pytest

from tests.backlog import full_backlog
from tests.server.conftest import paths
from tests.servers import accept_each
from tests.ws_proxy import ServedProxy, TunnelListener

pytestmark = paths(
    "wire",
    why="only the wire tunnels WebSockets; the ASGI app's refusal is tests/server/test_asgi_app.py",
)

#: How long the upstream holds the response a handshake is pipelined behind.
SLOW = 2.0

HANDSHAKE = (
    b"GET /v1/realtime HTTP/1.1\r\nHost: proxy.example\r\nUpgrade: websocket\r\n"
    b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    b"Sec-WebSocket-Version: 13\r\n\r\n"
)
SWITCH = (
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n"
)


class SlowThenSwitch:
    """An upstream that answers GET /slow after SLOW seconds and switches a handshake."""

    def __init__(self) -> None:
        self.sock = accept_each(self._serve, backlog=16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while True:
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                head, _, data = data.partition(b"\r\n\r\n")
                if b"upgrade: websocket" in head.lower():
                    conn.sendall(SWITCH)
                    while conn.recv(65536):  # until the proxy closes the tunnel
                        pass
                    return
                time.sleep(SLOW)
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    def stop(self) -> None:
        self.sock.close()


def _read_until(sock: socket.socket, end: bytes) -> bytes:
    data = b""
    while end not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _wait(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def slow_then_switch() -> Iterator[SlowThenSwitch]:
    upstream = SlowThenSwitch()
    yield upstream
    upstream.stop()


@pytest.fixture
def slow_to_accept() -> Iterator[str]:
    """An upstream whose accept queue is full: a connect to it hangs, its SYNs dropped."""
    with full_backlog(("127.0.0.1", 0)) as (host, port):
        yield f"http://{host}:{port}"


def test_a_handshake_pipelined_behind_a_slow_response_is_timed_from_its_arrival(
    slow_then_switch: SlowThenSwitch,
) -> None:
    proxy = ServedProxy(slow_then_switch.url).start()
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=15) as client:
            client.sendall(b"GET /slow HTTP/1.1\r\nHost: proxy.example\r\n\r\n" + HANDSHAKE)
            assert b"101 Switching Protocols" in _read_until(client, SWITCH[-20:])
        duration = "tokenprobe_websocket_session_duration_seconds_count"
        _wait(lambda: proxy.sample(duration, route="/v1/realtime") == 1, "the session's end")
        total = proxy.sample(
            "tokenprobe_websocket_session_duration_seconds_sum", route="/v1/realtime"
        )
        # Its turn came after the slow response's SLOW seconds; timed from the switch it
        # would be a few milliseconds.
        assert total >= SLOW * 0.9
    finally:
        proxy.stop()


@pytest.mark.parametrize("kind", ["listener", "serve"])
def test_a_slow_connect_counts_against_the_first_byte_timeout(
    kind: str, slow_to_accept: str
) -> None:
    settings = {"connect_timeout": 10, "first_byte_timeout": 1}
    proxy = (TunnelListener if kind == "listener" else ServedProxy)(
        slow_to_accept, **settings
    ).start()
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as client:
            sent = time.monotonic()
            client.sendall(HANDSHAKE)
            answer = _read_until(client, b"\r\n\r\n")
            waited = time.monotonic() - sent
        assert answer.startswith(b"HTTP/1.1 504 ")
        # An HTTP request's bound: 1 s from its going upstream, the connect included (a
        # loaded machine's slack, far short of the connect's 10 s).
        assert waited < 8
        sessions = "tokenprobe_websocket_sessions_total"
        _wait(
            lambda: proxy.sample(sessions, route="/v1/realtime", outcome="upstream_timeout") == 1,
            "the session counted as upstream_timeout",
        )
    finally:
        proxy.stop()
