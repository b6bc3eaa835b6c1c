"""A half-close the proxy cannot pass on: `tokenprobe serve` over TLS (asyncio writes no
EOF on a TLS transport) in front of a raw upstream that sends its close frame and then
shuts its sending (FIN). The client, told nothing of the FIN, still gets the close frame
and close_grace (2 s) to answer it; its answer reaches the upstream, and then the proxy
closes. The tunnel once ended at the upstream's FIN, and the answer was lost.

The plain-TCP half-closes, which the proxy passes on, are tests/tunnel/test_halfclose.py."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time

from tests.hostile.client import SWITCH, close_frame, ws_head
from tests.hostile.peers import Conn, ok, raw_upstream
from tests.server.conftest import paths
from tests.server.test_tls import CONTEXT, serving_tls

pytestmark = paths("wire", why="only the wire tunnels WebSockets (tests/server/test_websockets.py)")


GOING = close_frame(1001, b"going", masked=False)
ANSWER = close_frame(1000, b"ok", masked=True)


def test_a_tls_client_told_nothing_of_the_upstreams_fin_still_answers_its_close() -> None:
    got_upstream: list[bytes] = []

    async def script(conn: Conn) -> None:
        while (request := await conn.read_request()) is not None:
            if not request.header(b"upgrade"):  # the proxy's probes at its start
                conn.write(ok())
                await conn.drain()
                continue
            conn.write(SWITCH + GOING)
            conn.writer.write_eof()
            await conn.drain()
            try:
                got_upstream.append(await asyncio.wait_for(conn.reader.read(), 20.0))
            except (TimeoutError, ConnectionError) as exc:
                got_upstream.append(repr(exc).encode())
            return

    with raw_upstream() as upstream:
        upstream.default = script
        with serving_tls(upstream.url) as base:
            port = int(base.rsplit(":", 1)[1])
            with (
                socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
                CONTEXT.wrap_socket(raw, server_hostname="127.0.0.1") as client,
            ):
                client.sendall(ws_head())
                got = b""
                while not got.endswith(GOING):
                    chunk = client.recv(65536)
                    assert chunk, got
                    got += chunk
                assert got == SWITCH + GOING, got
                with contextlib.suppress(OSError):  # the proxy once closed at the FIN
                    client.sendall(ANSWER)
                started = time.monotonic()
                with contextlib.suppress(OSError, ssl.SSLError):
                    while client.recv(65536):  # until the proxy closes, after the grace
                        pass
                closed_after = time.monotonic() - started
            assert upstream.wait_for(lambda: bool(got_upstream), timeout=10.0)
    assert got_upstream == [ANSWER]
    assert closed_after < 10.0, closed_after  # close_grace, not --ws-idle-timeout
