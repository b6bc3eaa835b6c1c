"""The watch's frame budget end to end (proxy/server/tunnel/budget.py): the tunnel in this
process (tests/ws_proxy.py) between real peers on loopback.

- vLLM's realtime as the simulator serves it under uvicorn (permessage-deflate agreed as
  vLLM's uvicorn agrees it), a `websockets` client, and the proxy's loop stalled while
  the deltas come: a few hundred deltas of some 7 bytes in one read are measured.
- Floods of frames of 16 bytes, from either side: the watch reads a bounded number of
  them, says it stopped (`ws_frames`, a warning), and every byte goes on as sent.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.asyncio.client import connect

from proxy.core.observe import bare_record
from proxy.core.request import RequestInfo
from proxy.core.wsframes import WsMessage
from proxy.core.wsseam import WsApi, WsSession
from proxy.server.tunnel.budget import HELD
from proxy.sim import SimConfig
from tests.hostile.client import SWITCH, ws_head
from tests.hostile.peers import Conn, RawUpstream, keeping, raw_upstream
from tests.server.conftest import paths
from tests.sim.test_sim_support import running
from tests.ws_proxy import TunnelListener

pytestmark = paths("wire", why="only the wire tunnels WebSockets")

FAILURES = "tokenprobe_measurement_failures_total"


def _wait(condition: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# -- a real stream: compressed deltas behind a stalled proxy ------------------------------


@pytest.fixture(scope="module")
def sim_url() -> Iterator[str]:
    with running(SimConfig(models=("sim-model",))) as (server, _):
        yield server.url


def test_compressed_deltas_a_stalled_proxy_reads_at_once_are_measured(sim_url: str) -> None:
    """400 deltas at 400 a second, compressed to some 7 bytes each, while the proxy's loop
    is stalled for a second (a busy core, a slow sink): they come in one read. The guard
    against tiny frames took any read of more than 256 frames under 16 bytes for a flood,
    and the utterance went unrecorded."""
    tokens = 400
    proxy = TunnelListener(sim_url).start()
    pcm = base64.b64encode(b"\1\0" * 1600).decode()  # 0.1 s of PCM16 at 16 kHz
    headers = {"x-sim-ttft": "0", "x-sim-tps": "400", "x-sim-output-tokens": str(tokens)}

    async def session() -> tuple[str | None, int]:
        async with connect(proxy.url + "/v1/realtime", additional_headers=headers) as ws:
            assert ws.response is not None
            agreed = ws.response.headers.get("sec-websocket-extensions")
            await ws.recv()  # session.created
            for event in (
                {"type": "session.update", "model": "sim-model"},
                {"type": "input_audio_buffer.append", "audio": pcm},
                {"type": "input_audio_buffer.commit"},
            ):
                await ws.send(json.dumps(event))
            await asyncio.sleep(0.05)
            proxy.call(lambda: time.sleep(1.0))  # the proxy's loop stalls
            await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
            deltas = 0
            while json.loads(await ws.recv())["type"] != "transcription.done":
                deltas += 1
            return agreed, deltas

    try:
        agreed, deltas = asyncio.run(session())
        assert agreed is not None and agreed.startswith("permessage-deflate"), agreed
        assert deltas == tokens
        _wait(lambda: proxy.recorder.records, "the utterance's record")
        (record,) = proxy.recorder.records
        assert record.ok and record.output_tokens == tokens, record
        assert proxy.sample(FAILURES, stage="ws_frames") == 0
    finally:
        proxy.stop()


# -- floods: bounded reading, said, the bytes unchanged ----------------------------------


class _Seen(WsSession):
    def __init__(self, api: _Recording, record: Any) -> None:
        self.api, self.record = api, record

    def message(self, msg: WsMessage) -> None:
        self.api.messages.append(msg)

    def close(self, at: float, cause: str) -> None:
        info = RequestInfo("/v1/echo", "m", True, False, None, None)
        self.record(bare_record(info, status_code=101, started_at=0.0, e2e=0.0, error_type=None))


class _Recording(WsApi):
    """A WebSocket API that notes each message the watch hands it."""

    endpoint = "/v1/echo"
    paths = ("/v1/echo",)

    def __init__(self) -> None:
        self.messages: list[WsMessage] = []

    def open(
        self, *, start: float, started_at: float, path: str, query: str, record: Any
    ) -> WsSession:
        return _Seen(self, record)


@pytest.fixture
def upstream() -> Iterator[RawUpstream]:
    with raw_upstream() as server:
        yield server


def _most_in_one_read(messages: list[WsMessage]) -> int:
    """Messages are stamped with their read's instant: the most one read gave."""
    counts: dict[float, int] = {}
    for m in messages:
        counts[m.at] = counts.get(m.at, 0) + 1
    return max(counts.values(), default=0)


#: 16-byte frames: a masked ping with a 10-byte payload (the client's), an unmasked text
#: frame with a 14-byte one (the upstream's). The old guard let through any frame of 16.
CLIENT_PING = b"\x89\x8a" + b"abcd" + b"0123456789"
UPSTREAM_TEXT = b"\x81\x0e" + b"0123456789abcd"
FLOOD = 8192  # 128 KiB


def test_a_clients_flood_of_16_byte_frames_is_read_only_so_far_and_said(
    upstream: RawUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    assert len(CLIENT_PING) == 16
    hello = b"\x81\x85abcd" + bytes(b ^ k for b, k in zip(b"hello", b"abcda", strict=True))
    flood = CLIENT_PING * FLOOD
    received = bytearray()
    upstream.default = keeping(SWITCH, received)
    api = _Recording()
    proxy = TunnelListener(upstream.url, apis=lambda path: api).start()
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as client:
            client.sendall(ws_head(b"/v1/echo"))
            assert client.recv(4096).startswith(b"HTTP/1.1 101")
            client.sendall(hello)
            _wait(lambda: len(api.messages) == 1, "the first message watched")
            with caplog.at_level(logging.WARNING, logger="tokenprobe"):
                client.sendall(flood)
                _wait(lambda: len(received) == len(hello) + len(flood), "every byte upstream")
                _wait(
                    lambda: proxy.sample(FAILURES, stage="ws_frames") == 1,
                    "the watch to say it stopped",
                )
        assert bytes(received) == hello + flood
        assert len(api.messages) <= HELD + 1  # not 8193: the flood's rest is never read
        assert _most_in_one_read(api.messages[1:]) <= HELD
        assert "frames in one read from the client" in caplog.text
    finally:
        proxy.stop()


def test_an_upstreams_flood_right_after_its_101_is_not_read_and_is_said(
    upstream: RawUpstream,
) -> None:
    """Written with the 101: the frames in the 101's own read are under the same budget
    as any later read's."""
    flood = UPSTREAM_TEXT * FLOOD

    async def script(conn: Conn) -> None:
        await conn.read_request()
        conn.write(SWITCH + flood)
        await conn.drain()
        await conn.wait_closed_by_peer()

    upstream.default = script
    api = _Recording()
    proxy = TunnelListener(upstream.url, apis=lambda path: api).start()
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as client:
            client.sendall(ws_head(b"/v1/echo"))
            got = b""
            while len(got) < len(SWITCH) + len(flood):
                chunk = client.recv(1 << 16)
                assert chunk, "the proxy closed early"
                got += chunk
        assert got == SWITCH + flood
        _wait(lambda: proxy.sample(FAILURES, stage="ws_frames") == 1, "the watch to say it stopped")
        assert len(api.messages) <= HELD
        assert _most_in_one_read(api.messages) <= HELD
    finally:
        proxy.stop()
