"""A TCP half-close through an open tunnel, end to end in this process: the tunnel behind
the test listener (tests/ws_proxy.py), raw clients, the simulator's real /v1/realtime or a
raw upstream that writes exact bytes (tests/hostile/peers.py).

A WebSocket peer may send its close frame and then shut its sending (FIN): the other side
still answers with its own close frame, and closes. The proxy once ended the tunnel at the
FIN, so that answer was lost: a client library reported 1006 (abnormal closure) where,
direct, it got its 1000 back. Now the FIN is passed on and the tunnel ends when both sides
have ended."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable, Iterator

import pytest

from tests.conftest import Running
from tests.hostile.client import SWITCH, close_frame, ws_head
from tests.hostile.peers import Conn, RawUpstream, raw_upstream
from tests.ws_proxy import TunnelListener

SESSIONS = "tokenprobe_websocket_sessions_total"


def _read_until(sock: socket.socket, end: bytes, timeout: float = 10.0) -> bytes:
    sock.settimeout(timeout)
    got = b""
    while end not in got:
        chunk = sock.recv(65536)
        assert chunk, got
        got += chunk
    return got


def _rest(sock: socket.socket, timeout: float = 10.0) -> tuple[bytes, bool]:
    """Everything until the peer's FIN; (what came, whether the FIN came in `timeout`)."""
    got = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            return got, True
        got += chunk
    return got, False


def _wait(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def sim_proxy(sim: Running) -> Iterator[TunnelListener]:
    listener = TunnelListener(sim.url).start()
    try:
        yield listener
    finally:
        listener.stop()


def test_a_client_that_shuts_its_sending_after_its_close_gets_the_upstreams_close(
    sim_proxy: TunnelListener,
) -> None:
    """The simulator's /v1/realtime answers a close frame with its own (1000, "bye", the
    client's reason echoed) and closes: the client gets it, then the proxy's FIN."""
    with socket.create_connection(("127.0.0.1", sim_proxy.port), timeout=10) as client:
        client.sendall(ws_head())
        _read_until(client, b"session.created")
        client.sendall(close_frame(1000, b"bye", masked=True))
        client.shutdown(socket.SHUT_WR)
        rest, fin = _rest(client)
    assert rest == close_frame(1000, b"bye", masked=False) and fin, rest
    _wait(lambda: sim_proxy.open_tunnels() == 0)
    assert sim_proxy.sample(SESSIONS, route="/v1/realtime", outcome="closed_by_client") == 1


@pytest.fixture
def upstream() -> Iterator[RawUpstream]:
    with raw_upstream() as server:
        yield server


def test_an_upstream_that_shuts_its_sending_after_its_close_gets_the_clients_close(
    upstream: RawUpstream,
) -> None:
    """The same the other way: the upstream's close frame and FIN reach the client as
    they came, and the client's answering close reaches the upstream."""
    got_upstream: list[bytes] = []
    answer = close_frame(1000, b"ok", masked=True)

    async def script(conn: Conn) -> None:
        await conn.read_request()
        conn.write(SWITCH + close_frame(1001, b"going", masked=False))
        conn.writer.write_eof()
        await conn.drain()
        try:
            got_upstream.append(await asyncio.wait_for(conn.reader.read(), 10.0))
        except (TimeoutError, ConnectionError) as exc:
            got_upstream.append(repr(exc).encode())

    upstream.default = script
    proxy = TunnelListener(upstream.url).start()
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as client:
            client.sendall(ws_head())
            got, fin = _rest(client)
            assert got == SWITCH + close_frame(1001, b"going", masked=False) and fin, got
            with contextlib.suppress(OSError):  # the proxy once closed at the upstream's FIN
                client.sendall(answer)
                client.shutdown(socket.SHUT_WR)
                _rest(client)
        _wait(lambda: bool(got_upstream))
        assert got_upstream == [answer]
        _wait(lambda: proxy.open_tunnels() == 0)
        assert proxy.sample(SESSIONS, route="/v1/realtime", outcome="closed_by_upstream") == 1
    finally:
        proxy.stop()


def test_a_half_closed_tunnel_whose_other_side_stays_ends_after_the_close_grace(
    upstream: RawUpstream,
) -> None:
    """A client's FIN goes upstream; an upstream that neither answers nor closes is cut
    close_grace (2 s) after the FIN, far before --ws-idle-timeout: a client gone holds no
    tunnel, nor the upstream's generation, longer than that."""

    async def script(conn: Conn) -> None:
        await conn.read_request()
        conn.write(SWITCH)
        await conn.drain()
        await conn.reader.read()  # the FIN passed on
        await asyncio.sleep(30)  # never closes: only the proxy does

    upstream.default = script
    proxy = TunnelListener(upstream.url, ws_idle_timeout=300.0).start()
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as client:
            client.sendall(ws_head())
            _read_until(client, b"\r\n\r\n")
            client.shutdown(socket.SHUT_WR)
            started = time.monotonic()
            _, fin = _rest(client, timeout=20.0)
            took = time.monotonic() - started
        assert fin and took < 15.0, took
        _wait(lambda: proxy.open_tunnels() == 0)
        assert proxy.sample(SESSIONS, route="/v1/realtime", outcome="client_vanished") == 1
    finally:
        proxy.stop()


def test_a_client_that_shuts_its_sending_without_a_close_frame_vanished(
    upstream: RawUpstream,
) -> None:
    """No close frame, only the client's FIN: the upstream closes in answer to it, and
    the session is the client's doing (`client_vanished`), as when the tunnel ended at
    the FIN itself, not the upstream's."""

    async def script(conn: Conn) -> None:
        await conn.read_request()
        conn.write(SWITCH)
        await conn.drain()
        await conn.reader.read()  # to the FIN passed on; then the upstream closes

    upstream.default = script
    proxy = TunnelListener(upstream.url).start()
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as client:
            client.sendall(ws_head())
            _read_until(client, b"\r\n\r\n")
            client.shutdown(socket.SHUT_WR)
            _, fin = _rest(client)
        assert fin
        _wait(lambda: proxy.open_tunnels() == 0)
        assert proxy.sample(SESSIONS, route="/v1/realtime", outcome="client_vanished") == 1
        assert proxy.sample(SESSIONS, route="/v1/realtime", outcome="upstream_vanished") == 0
    finally:
        proxy.stop()
