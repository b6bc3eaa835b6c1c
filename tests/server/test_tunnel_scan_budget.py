"""The scan of frame headers under its budget (proxy/server/tunnel/budget.py, `scan_budget`):
floods of 2-byte frames, the smallest there are, between real peers on loopback.

Finding where frames end ran over every header of every read, watched tunnel or not:
256 KiB of 2-byte frames held the proxy's loop 28 to 40 ms a read, and 16 MiB of them
held `tokenprobe serve`'s loop over a second at a time (its loop-lag sampler woke 1 to
2.5 s late). Now a read scans at most `SCAN_HELD` headers (some 1 to 2 ms); a direction
that sends more is no longer followed, said and counted, and its bytes go on as sent.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from proxy.server.tunnel.budget import HELD
from tests.hostile.client import SWITCH, ws_head
from tests.hostile.peers import Conn, RawUpstream, raw_upstream
from tests.scrape import scrape
from tests.server.conftest import paths
from tests.server.test_tunnel_frame_budget import FAILURES, _Recording
from tests.ws_proxy import ServedProxy, TunnelListener

pytestmark = paths("wire", why="only the wire tunnels WebSockets")

#: An unmasked ping with no payload: 2 bytes, as an upstream may send it.
PING = b"\x89\x00"
CHUNK = PING * (128 * 1024)  # 256 KiB, a whole read: 131072 frames
LAG = "tokenprobe_event_loop_lag_seconds"
#: The longest the proxy's loop-lag sampler may wake late during the flood. A read is
#: scanned for some 1 to 2 ms now; 0.1 s leaves room for a loaded 2-core machine, and
#: the unbudgeted scan held the loop 1 to 2.5 s.
MOST_LAG = "0.1"


@pytest.fixture
def upstream() -> Iterator[RawUpstream]:
    with raw_upstream() as server:
        yield server


def _read_all(client: socket.socket, want: int) -> bytes:
    got = bytearray()
    while len(got) < want:
        chunk = client.recv(1 << 20)
        assert chunk, f"the proxy closed after {len(got)} of {want} bytes"
        got += chunk
    return bytes(got)


def _wait(condition: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_flood_of_2_byte_frames_through_serve_never_holds_its_loop(
    upstream: RawUpstream,
) -> None:
    """An upstream sends 256 KiB of 2-byte frames every 15 ms for some 1.5 s, on a path
    no API watches: the proxy's loop-lag sampler, waking through the flood, is never late
    past MOST_LAG; every byte reaches the client as sent; the loss is counted once."""
    chunks = 100

    async def script(conn: Conn) -> None:
        await conn.read_request()
        conn.write(SWITCH)
        for _ in range(chunks):
            conn.write(CHUNK)
            await conn.drain()
            await asyncio.sleep(0.015)
        await conn.wait_closed_by_peer(30)

    upstream.default = script
    proxy = ServedProxy(upstream.url).start()
    try:
        before = scrape(proxy.base)
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as client:
            client.sendall(ws_head(b"/v1/echo"))
            got = _read_all(client, len(SWITCH) + chunks * len(CHUNK))
        after = scrape(proxy.base)
        assert got == SWITCH + CHUNK * chunks
        samples = after.value(LAG + "_count") - before.value(LAG + "_count")
        assert samples >= 3, "the sampler must wake during the flood for the bound to mean much"
        within = after.value(LAG + "_bucket", le=MOST_LAG) - before.value(
            LAG + "_bucket", le=MOST_LAG
        )
        assert within == samples, f"{samples - within} of {samples} samples over {MOST_LAG} s"
        assert after.value(FAILURES, stage="ws_frames") == 1
    finally:
        proxy.stop()


def test_a_watched_sessions_flood_stops_the_scan_said_and_counted(
    upstream: RawUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    """On a path an API watches, written with the 101: the scan reads no more than
    SCAN_HELD headers of the read, the reading none past its own budget, and the
    watching stops once, said; every byte goes on as sent."""
    chunks = 8

    async def script(conn: Conn) -> None:
        await conn.read_request()
        conn.write(SWITCH + CHUNK * chunks)
        await conn.drain()
        await conn.wait_closed_by_peer()

    upstream.default = script
    api = _Recording()
    proxy = TunnelListener(upstream.url, apis=lambda path: api).start()
    try:
        with caplog.at_level(logging.WARNING, logger="tokenprobe"):
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as client:
                client.sendall(ws_head(b"/v1/echo"))
                got = _read_all(client, len(SWITCH) + chunks * len(CHUNK))
            assert got == SWITCH + CHUNK * chunks
            _wait(lambda: proxy.open_tunnels() == 0, "the tunnel to end")
        assert proxy.sample(FAILURES, stage="ws_frames") == 1
        assert "more than its scanning budget" in caplog.text
        assert len(api.messages) <= HELD
    finally:
        proxy.stop()
