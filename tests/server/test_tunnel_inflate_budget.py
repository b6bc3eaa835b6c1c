"""Compressed WebSocket messages end to end: the tunnel in this process (tests/ws_proxy.py)
between a raw upstream that agrees permessage-deflate (as vLLM's uvicorn does by default)
and a raw client on loopback.

- A deflate bomb from the client (300 messages of 4,000,000 "a"s, 3.9 KB each on the
  wire): the watch inflates a bounded number of them (budget.py, `inflate_budget`), says
  it stopped (`ws_frames`, one warning), every byte goes on as sent, and another
  connection is answered at once. It held the loop 4 to 6 s, nothing counted.
- An upstream that answers 101 with its close frame in the same read, and a client whose
  realtime events were held until the 101: they come after the upstream's close, and
  open no utterance (RFC 6455 §1.4, §5.5.1). One was recorded, stream_truncated.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import time
import zlib
from collections.abc import Iterator
from typing import Any

import pytest

from proxy.server.tunnel.budget import INFLATE_HELD
from tests.hostile.client import SWITCH, Switcher, ws_head
from tests.hostile.peers import RawUpstream, keeping, raw_upstream
from tests.server.conftest import paths
from tests.server.test_tunnel_frame_budget import _Recording
from tests.ws_proxy import TunnelListener

pytestmark = paths("wire", why="only the wire tunnels WebSockets")

FAILURES = "tokenprobe_measurement_failures_total"
DEFLATE = b"Sec-WebSocket-Extensions: permessage-deflate\r\n"
BOMB_TEXT = 4_000_000


def _wait(condition: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _bomb() -> bytes:
    """A masked (zero key), compressed text frame: 4,000,000 "a"s in some 3.9 KB."""
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    payload = (deflate.compress(b"a" * BOMB_TEXT) + deflate.flush(zlib.Z_SYNC_FLUSH))[:-4]
    return b"\xc1\xfe" + struct.pack("!H", len(payload)) + b"\0\0\0\0" + payload


@pytest.fixture
def upstream() -> Iterator[RawUpstream]:
    with raw_upstream() as server:
        yield server


def _answered_after(port: int) -> float:
    """Seconds another connection waits for its answer (the listener's 400 to a plain GET:
    the same loop the tunnels run on, as /healthz on the wire)."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as other:
        other.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert other.recv(4096).startswith(b"HTTP/1.1 ")
    return time.monotonic() - started


def test_a_clients_deflate_bomb_is_inflated_only_so_far_and_said(
    upstream: RawUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    bomb = _bomb()
    assert len(bomb) < 4000
    count = 300  # 1.17 MB on the wire, 1.2 GB inflated
    flood = bomb * count
    received = bytearray()
    upstream.default = keeping(SWITCH.replace(b"\r\n\r\n", b"\r\n" + DEFLATE + b"\r\n"), received)
    api = _Recording()
    proxy = TunnelListener(upstream.url, apis=lambda path: api).start()
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as client:
            client.sendall(ws_head(b"/v1/echo", extra=DEFLATE))
            assert client.recv(4096).startswith(b"HTTP/1.1 101")
            with caplog.at_level(logging.WARNING, logger="tokenprobe"):
                client.sendall(flood)
                waited = _answered_after(proxy.port)
                _wait(lambda: len(received) == len(flood), "every byte upstream")
                _wait(
                    lambda: proxy.sample(FAILURES, stage="ws_frames") == 1,
                    "the watch to say it stopped",
                )
        assert bytes(received) == flood
        assert waited < 0.5, waited  # it was 4 to 6 s
        # What the direction holds, and at most a message more: not 300 of them.
        assert len(api.messages) <= INFLATE_HELD // BOMB_TEXT + 1
        assert caplog.text.count("inflate faster than its inflating budget") == 1
    finally:
        proxy.stop()


def _text(event: dict[str, Any]) -> bytes:
    """A client's text frame, masked with a zero key."""
    payload = json.dumps(event).encode()
    assert 126 <= len(payload) < 65536 or len(payload) < 126
    length = bytes([0x80 | len(payload)]) if len(payload) < 126 else b"\xfe"
    if len(payload) >= 126:
        length += struct.pack("!H", len(payload))
    return b"\x81" + length + b"\0\0\0\0" + payload


def test_events_held_until_a_101_that_came_with_the_upstreams_close_open_no_utterance(
    upstream: RawUpstream,
) -> None:
    """The client's session.update, 1 s of audio and a commit, sent with its handshake and
    held until the 101; the upstream's 101 comes with its close frame (1000) in one read.
    The session ends closed_by_upstream, and the upstream took no utterance: none is
    recorded (one was, model "m", stream_truncated)."""
    upstream.default = Switcher(answer=SWITCH + b"\x88\x02\x03\xe8", delay=0.0).script()
    audio = "AAAA" * 8000  # 1 s of PCM16 at 16 kHz, base64
    events = b"".join(
        _text(event)
        for event in (
            {"type": "session.update", "model": "m"},
            {"type": "input_audio_buffer.append", "audio": audio},
            {"type": "input_audio_buffer.commit"},
        )
    )
    proxy = TunnelListener(upstream.url).start()  # the real realtime API
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as client:
            client.sendall(ws_head(b"/v1/realtime") + events)
            got = b""
            while not got.endswith(b"\x88\x02\x03\xe8"):
                chunk = client.recv(4096)
                assert chunk, got
                got += chunk
            assert got.startswith(b"HTTP/1.1 101")
            client.sendall(b"\x88\x82\0\0\0\0\x03\xe8")  # the client's answer
        _wait(lambda: proxy.open_tunnels() == 0, "the session's end")  # the client hung up
        sessions = "tokenprobe_websocket_sessions_total"
        _wait(
            lambda: proxy.sample(sessions, outcome="closed_by_upstream", route="/v1/realtime") == 1,
            "the session counted closed_by_upstream",
        )
        assert proxy.recorder.records == []
    finally:
        proxy.stop()
