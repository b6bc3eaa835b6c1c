"""What a worker's tunnels may hold together: how many are open (--ws-max-tunnels), and
the bytes their frame readers hold of half-received messages (context.py
`HELD_MESSAGE_BYTES`). End to end in this process: the tunnel behind the test listener
(tests/ws_proxy.py) in front of a raw upstream (tests/hostile/peers.py), raw clients.

Without them 2,000 tunnels opened by one client were all answered 101 and held, and 40
tunnels each holding a compressed message half-sent (4 MiB once inflated) took the proxy's
RSS from 49 to 211 MB.
"""

from __future__ import annotations

import json
import socket
import struct
import time
import zlib
from collections.abc import Callable, Iterator

import pytest

from proxy.core.wsframes import UNHELD, FrameReader, HeldBytes
from tests.hostile.client import SWITCH, responses, ws_head
from tests.hostile.peers import Conn, RawUpstream, Request, raw_upstream
from tests.ws_proxy import TunnelListener

SESSIONS = "tokenprobe_websocket_sessions_total"
FAILURES = "tokenprobe_measurement_failures_total"
DEFLATE = b"Sec-WebSocket-Extensions: permessage-deflate\r\n"


@pytest.fixture
def upstream() -> Iterator[RawUpstream]:
    """Switches every handshake (permessage-deflate agreed, as vLLM's uvicorn does) and
    keeps what each connection sent after it."""
    with raw_upstream() as server:

        async def script(conn: Conn) -> None:
            await conn.read_request()
            conn.write(SWITCH.replace(b"\r\n\r\n", b"\r\n" + DEFLATE + b"\r\n"))
            await conn.drain()
            while await conn.reader.read(1 << 16):
                pass

        server.default = script
        yield server


def _wait(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _open(port: int) -> tuple[socket.socket, bytes]:
    """A client's handshake to /v1/realtime (a measured path), and the proxy's answer."""
    client = socket.create_connection(("127.0.0.1", port), timeout=10)
    client.sendall(ws_head(b"/v1/realtime", extra=DEFLATE))
    answer = client.recv(65536)
    return client, answer


def test_a_handshake_past_the_cap_is_answered_503_before_anything_goes_upstream(
    upstream: RawUpstream,
) -> None:
    proxy = TunnelListener(upstream.url, ws_max_tunnels=2).start()
    clients: list[socket.socket] = []
    try:
        for _ in range(2):
            client, answer = _open(proxy.port)
            clients.append(client)
            assert answer.startswith(b"HTTP/1.1 101"), answer
        _wait(lambda: upstream.connections == 2, "two handshakes upstream")

        over, answer = _open(proxy.port)
        clients.append(over)
        assert answer.startswith(b"HTTP/1.1 503"), answer
        while not answer.endswith(b"}"):  # the whole answer, then the close
            more = over.recv(65536)
            assert more, answer
            answer += more
        assert over.recv(1) == b""  # the connection closes after it
        ((status, head, body),) = responses(answer)
        assert status == 503
        assert Request(head, b"").header(b"retry-after") == [b"1"]
        error = json.loads(body)["error"]
        assert error["type"] == "too_many_websockets" and error["code"] == 503
        assert "--ws-max-tunnels" in error["message"]
        assert upstream.connections == 2  # nothing went upstream
        _wait(
            lambda: (
                proxy.sample(SESSIONS, route="/v1/realtime", outcome="too_many_websockets") == 1
            ),
            "the shed session counted",
        )
        assert proxy.open_tunnels() == 2

        clients[0].close()  # one ends: the next handshake is tunnelled again
        _wait(lambda: proxy.open_tunnels() == 1, "the tunnel to end")
        client, answer = _open(proxy.port)
        clients.append(client)
        assert answer.startswith(b"HTTP/1.1 101"), answer
    finally:
        for client in clients:
            client.close()
        proxy.stop()


def _frame(first: int, payload: bytes) -> bytes:
    """A client's frame (masked with a zero key): `first` is its first byte."""
    if len(payload) < 126:
        return bytes((first, 0x80 | len(payload))) + b"\0\0\0\0" + payload
    return bytes((first, 0xFE)) + struct.pack("!H", len(payload)) + b"\0\0\0\0" + payload


def _halves(size: int) -> tuple[bytes, bytes]:
    """A compressed text message of `size` bytes inflated, in two frames: the first
    (RSV1, no FIN) inflates to all but its last byte, the second ends it."""
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = deflate.compress(b"a" * (size - 1)) + deflate.flush(zlib.Z_SYNC_FLUSH)
    last = (deflate.compress(b"a") + deflate.flush(zlib.Z_SYNC_FLUSH))[:-4]
    return _frame(0x41, first), _frame(0x80, last)


def test_half_received_messages_are_held_within_the_workers_bound(
    upstream: RawUpstream,
) -> None:
    size = 100_000
    proxy = TunnelListener(upstream.url).start()
    assert proxy.context is not None
    held = proxy.context.held = HeldBytes(2 * size + size // 2)  # room for two, not three
    first, last = _halves(size)
    clients: list[socket.socket] = []
    try:
        for _ in range(3):
            client, answer = _open(proxy.port)
            assert answer.startswith(b"HTTP/1.1 101"), answer
            clients.append(client)
            client.sendall(first)  # each tunnel holds a message half-sent
        _wait(lambda: proxy.sample(FAILURES, stage="ws_memory_bound") == 1, "the skip counted")
        assert held.held == 2 * (size - 1)  # the third was not held
        _wait(
            lambda: [bytes(r).endswith(first) for r in upstream.received] == [True] * 3,
            "every byte upstream, as sent",
        )

        clients[2].sendall(last)  # the skipped one ends: counted once, when skipped
        clients[0].sendall(last)  # a held one ends: given back
        _wait(lambda: held.held == size - 1, "the ended message given back")
        clients[1].close()  # a tunnel ends with one held: given back
        _wait(lambda: held.held == 0, "the ended tunnel's message given back")
        clients[2].sendall(first)  # there is room again: held
        _wait(lambda: held.held == size - 1, "a message held again")
        assert proxy.sample(FAILURES, stage="ws_memory_bound") == 1
        assert proxy.sample(FAILURES, stage="ws_message_too_large") == 0
    finally:
        for client in clients:
            client.close()
        # each client's FIN goes upstream, and the tunnel ends at the upstream's answering
        # close (a round trip): the listener's loop runs until then
        upstream.wait_for(lambda: proxy.open_tunnels() == 0)
        proxy.stop()
    _wait(lambda: held.held == 0, "every tunnel's given back")


def test_readers_share_the_bound_and_say_a_message_they_cannot_hold_at_once() -> None:
    """Two readers (two tunnels' clients), uncompressed fragments: what one holds leaves
    the other no room, its message comes as UNHELD as soon as it is skipped (not at its
    end), and the next message is read whole once there is room again."""
    held = HeldBytes(10)
    one, two = FrameReader(True, None, 100, held), FrameReader(True, None, 100, held)
    assert one.feed(_frame(0x01, b"x" * 8), 0.0) == []  # TEXT, no FIN: held
    assert held.held == 8
    (unheld,) = two.feed(_frame(0x01, b"y" * 8), 1.0)  # no room for 8 more
    assert (unheld.kind, unheld.data, unheld.at) == (UNHELD, b"", 1.0)
    assert held.held == 8
    assert two.feed(_frame(0x80, b"y"), 2.0) == []  # its end: said already
    (whole,) = one.feed(_frame(0x80, b"x"), 3.0)
    assert (whole.kind, whole.data) == ("text", b"x" * 9)
    assert held.held == 0
    assert two.feed(_frame(0x01, b"z" * 8), 4.0) == []  # room again
    assert held.held == 8
    two.release()  # its owner drops it: what it held is given back
    assert held.held == 0
