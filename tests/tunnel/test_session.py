"""One tunnel end to end (proxy/server/tunnel/session.py), in this process: the tunnel
behind the test listener (tests/ws_proxy.py) in front of a raw upstream that writes exact
bytes (tests/hostile/peers.py), a raw client. How the handshake's wait ends, a 101 that
names no Connection, what a record's error keeps, and a burst of deltas in one read."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator

import pytest

from tests.hostile.client import SWITCH, responses, ws_head
from tests.hostile.peers import Conn, RawUpstream, exchange, raw_upstream
from tests.ws_proxy import TunnelListener


@pytest.fixture
def upstream() -> Iterator[RawUpstream]:
    with raw_upstream() as server:
        yield server


def _listener(upstream: RawUpstream, **settings: object) -> TunnelListener:
    return TunnelListener(upstream.url, **settings).start()


def _wait(condition: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _frame(payload: bytes, *, masked: bool) -> bytes:
    """A text frame (payloads under 126 bytes), masked with a zero key from the client."""
    assert len(payload) < 126
    if masked:
        return bytes((0x81, 0x80 | len(payload))) + b"\0\0\0\0" + payload
    return bytes((0x81, len(payload))) + payload


def _event(masked: bool = False, **event: object) -> bytes:
    return _frame(json.dumps(event, separators=(",", ":")).encode(), masked=masked)


def test_a_handshake_never_answered_gets_the_504_though_the_idle_timeout_is_shorter(
    upstream: RawUpstream,
) -> None:
    """--ws-idle-timeout shorter than --first-byte-timeout (the defaults: 300 s and 600 s):
    the wait for the upstream's answer is the first-byte timeout's, and the client gets its
    504. The idle timer once ran from the handshake's sending and cut such a wait with a
    bare close, counted idle_timeout."""

    async def silent(conn: Conn) -> None:
        await conn.read_request()
        await conn.wait_closed_by_peer(timeout=5.0)

    upstream.default = silent
    proxy = _listener(upstream, first_byte_timeout=0.4, ws_idle_timeout=0.1)
    try:
        got = exchange(f"http://127.0.0.1:{proxy.port}", ws_head(), idle=2.0, total=3.0)
        ((status, _, body),) = responses(got)
        assert status == 504 and b"upstream_timeout" in body, got
        _wait(lambda: proxy.open_tunnels() == 0)
        sessions = "tokenprobe_websocket_sessions_total"
        assert proxy.sample(sessions, route="/v1/realtime", outcome="upstream_timeout") == 1
    finally:
        proxy.stop()


def test_a_101_without_connection_upgrade_opens_the_tunnel_both_ways(
    upstream: RawUpstream,
) -> None:
    """llhttp stops after any 101, but httptools calls it an upgrade only with
    `Connection: Upgrade`: the tunnel stayed shut while the 101 and the upstream's frames
    reached the client, and the client's frames never went. Any 101 is the switch (nginx)."""
    switch = SWITCH.replace(b"Connection: Upgrade\r\n", b"")
    created = _event(type="session.created", id="sess-1", created=1)
    update = _event(True, type="session.update", model="m")
    got_upstream: list[bytes] = []

    async def script(conn: Conn) -> None:
        await conn.read_request()
        conn.write(switch + created)
        await conn.drain()
        got_upstream.append(await conn.reader.readexactly(len(update)))
        conn.write(
            _event(type="error", error="The model `m` does not exist.", code="model_not_found")
        )
        await conn.drain()
        await conn.wait_closed_by_peer(timeout=5.0)

    upstream.default = script
    proxy = _listener(upstream)
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=3) as client:
            client.sendall(ws_head())
            seen = b""
            while not seen.endswith(created):
                seen += client.recv(65536)
            assert seen == switch + created
            client.sendall(update)
            _wait(lambda: got_upstream)
            assert got_upstream == [update]
            _wait(lambda: proxy.recorder.records)
        (record,) = proxy.recorder.records
        assert (record.model, record.error_type.value if record.error_type else None) == (
            "m",
            "not_found",
        )
    finally:
        proxy.stop()


#: A key in no known shape (no `sk-`, no JWT): only masking the session's own header
#: values finds it, and only whole.
KEY = "ZQ8pLk3vTy6Wm9Rb2Nx5"


def test_a_key_the_error_texts_cut_would_split_is_masked_whole_first(
    upstream: RawUpstream,
) -> None:
    """The upstream echoes the client's x-api-key where a record's 200-character cut
    falls: the seam cut the text before the tunnel masked whole header values, so the
    key's first half reached the record (and the access log)."""
    filler = "x" * (200 - len("invalid_api_key: ") - 10)
    error = json.dumps({"type": "error", "error": filler + KEY, "code": "invalid_api_key"})
    payload = error.encode()
    frame = bytes((0x81, 126)) + len(payload).to_bytes(2, "big") + payload

    async def script(conn: Conn) -> None:
        await conn.read_request()
        conn.write(SWITCH + frame)
        await conn.drain()
        await conn.wait_closed_by_peer(timeout=5.0)

    upstream.default = script
    proxy = _listener(upstream)
    try:
        head = ws_head(extra=b"X-Api-Key: " + KEY.encode() + b"\r\n")
        exchange(f"http://127.0.0.1:{proxy.port}", head, idle=0.3, total=3.0)
        _wait(lambda: proxy.recorder.records)
        (record,) = proxy.recorder.records
        message = record.error_message or ""
        assert message.startswith("invalid_api_key: xxx") and len(message) <= 200, message
        assert KEY[:4] not in message, message
    finally:
        proxy.stop()


def test_300_vllm_deltas_in_one_read_are_measured(upstream: RawUpstream) -> None:
    """vLLM's deltas (`{"type":"transcription.delta","delta":" word"}`, 45 bytes a frame)
    written at once, as a stalled proxy reads them: the utterance is recorded. The guard
    against floods of tiny frames once took any read of 256 frames under 256 bytes for
    one, and the utterance went unrecorded. (300 frames 50 ms after the 101: within what
    a direction starts with and earns, proxy/server/tunnel/budget.py.)"""
    n = 300
    deltas = _event(type="transcription.delta", delta=" word") * n
    usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
    done = _event(type="transcription.done", text="x", usage=usage)
    commit = _event(True, type="input_audio_buffer.commit")
    update = _event(True, type="session.update", model="m")

    async def script(conn: Conn) -> None:
        await conn.read_request()
        conn.write(SWITCH)
        await conn.drain()
        await conn.reader.readexactly(len(update) + len(commit))
        await asyncio.sleep(0.05)  # the commit is read before the deltas come
        conn.write(deltas + done)
        await conn.drain()
        await conn.wait_closed_by_peer(timeout=5.0)

    upstream.default = script
    proxy = _listener(upstream)
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=3) as client:
            client.sendall(ws_head() + update + commit)
            seen = b""
            while not seen.endswith(done):
                seen += client.recv(65536)
            _wait(lambda: proxy.recorder.records)
        (record,) = proxy.recorder.records
        assert record.ok and (record.output_tokens, record.content_events) == (n, n)
        assert proxy.sample("tokenprobe_measurement_failures_total", stage="ws_frames") == 0
    finally:
        proxy.stop()
