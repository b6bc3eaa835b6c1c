"""A TLS client's own half-close, which the tunnel cannot pass on: `tokenprobe serve` over
TLS in front of a raw upstream (tests/hostile/peers.py), and a client on a memory BIO that
sends its close frame, then its `close_notify` (TCP left open), and reads on, as Go's
`tls.Conn.CloseWrite` or rustls' `send_close_notify` let a client do (TLS 1.3 allows
reading after it: RFC 8446 §6.1).

Over plain TCP such a half-close (the client's FIN) is passed on, and the upstream's close
reaches the client (tests/tunnel/test_halfclose.py). Over TLS it cannot be: asyncio's TLS
transport, CPython's and uvloop's alike, answers a close_notify with its own and closes,
whatever the protocol's `eof_received` returns, and drops what is written after it
(docs/hostile-peers.md has the source). What this pins is what holds all the same: the
client's close frame reaches the upstream whole, and the tunnel ends at once, the
upstream's connection closed, not held for the idle timeout. The
upstream answers only once the proxy has closed on it: were asyncio's transport ever to
stay half-open, its close would reach the client here, and the page would need updating."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time

from tests.hostile.client import SWITCH, close_frame, ws_head
from tests.hostile.peers import Conn, ok, raw_upstream
from tests.server.test_tls import CONTEXT, serving_tls

BYE = close_frame(1000, b"bye", masked=True)
ANSWER = close_frame(1000, b"bye", masked=False)


class HalfClosingClient:
    """TLS on a memory BIO over a plain socket: `close_notify` sends the alert and leaves
    the socket open, which no `ssl.SSLSocket` call does (`unwrap` waits for the peer's)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = CONTEXT.wrap_bio(self.incoming, self.outgoing, server_hostname="127.0.0.1")
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                self._fill(10.0)
        self._flush()

    def _flush(self) -> None:
        if data := self.outgoing.read():
            self.sock.sendall(data)

    def _fill(self, timeout: float) -> None:
        self.sock.settimeout(timeout)
        data = self.sock.recv(65536)
        if data:
            self.incoming.write(data)
        else:
            self.incoming.write_eof()

    def send(self, data: bytes) -> None:
        self.tls.write(data)
        self._flush()

    def close_notify(self) -> None:
        with contextlib.suppress(ssl.SSLWantReadError):  # sent; the peer's not yet read
            self.tls.unwrap()
        self._flush()

    def read_until(self, end: bytes) -> bytes:
        got = b""
        while end not in got:
            try:
                got += self.tls.read(65536)
            except ssl.SSLWantReadError:
                self._fill(10.0)
        return got

    def rest(self, timeout: float) -> tuple[bytes, bool]:
        """What comes until the proxy ends the connection (its close_notify or FIN);
        (what came, whether it ended within `timeout`)."""
        got = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = self.tls.read(65536)
            except ssl.SSLWantReadError:
                try:
                    self._fill(max(0.01, deadline - time.monotonic()))
                except TimeoutError:
                    return got, False
                continue
            except ssl.SSLError:  # the connection ended under the TLS layer
                return got, True
            if not chunk:
                return got, True
            got += chunk
        return got, False

    def close(self) -> None:
        self.sock.close()


def test_a_tls_clients_close_notify_ends_the_tunnel_its_close_frame_delivered() -> None:
    seen: list[bytes] = []
    closed_after: list[float] = []

    async def script(conn: Conn) -> None:
        while (request := await conn.read_request()) is not None:
            if not request.header(b"upgrade"):  # the proxy's probes at its start
                conn.write(ok())
                await conn.drain()
                continue
            conn.write(SWITCH)
            await conn.drain()
            seen.append(await conn.reader.readexactly(len(BYE)))
            started = time.monotonic()
            seen.append(await asyncio.wait_for(conn.reader.read(), 20.0))  # to the close
            closed_after.append(time.monotonic() - started)
            try:  # the answer, now that nothing can take it
                conn.write(ANSWER)
                await conn.drain()
            except ConnectionError:
                pass
            return

    with raw_upstream() as upstream:
        upstream.default = script
        with serving_tls(upstream.url) as base:
            client = HalfClosingClient(int(base.rsplit(":", 1)[1]))
            try:
                client.send(ws_head())
                assert client.read_until(b"\r\n\r\n") == SWITCH
                client.send(BYE)
                client.close_notify()
                rest, ended = client.rest(timeout=20.0)
            finally:
                client.close()
            assert upstream.wait_for(lambda: bool(closed_after), timeout=20.0)
    assert seen == [BYE, b""]  # the client's close, whole; then the proxy's FIN
    assert closed_after[0] < 10.0, closed_after  # at once, not at --ws-idle-timeout (300 s)
    assert rest == b"" and ended, rest  # asyncio's TLS transport closed at close_notify
