"""One registry of open WebSocket tunnels (proxy/server/tunnel/registry.py), and one drain
through it, for the wire and the test listener (tests/ws_proxy.py) alike: the tests of the
tunnel's drain, run behind the listener, then run the drain production runs (`Wire.close`)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from proxy.server.tunnel import OpenTunnels
from tests.conftest import ProxyUnderTest
from tests.server.conftest import paths
from tests.ws_proxy import TunnelListener
from tests.ws_upstream import EchoUpstream

pytestmark = paths("wire", why="only the wire tunnels WebSockets")

GOING_AWAY = 1001  # the drain's close code (proxy/server/tunnel/watch.py)


@pytest.fixture
def upstream() -> Iterator[EchoUpstream]:
    server = EchoUpstream().start()
    yield server
    server.stop()


def _wait(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _drained_session(url: str, registry: OpenTunnels, drain: Callable[[], None]) -> int | None:
    """A session that echoes once, is seen open in `registry`, then drained by `drain`:
    the close code the client got."""

    async def session() -> int | None:
        async with connect(url + "/v1/realtime?model=m", compression=None) as ws:
            await ws.send('{"type":"session.update","session":{}}')
            await asyncio.wait_for(ws.recv(), 10)
            assert len(registry) == 1, "the open session is not in the registry"
            await asyncio.to_thread(drain)
            with pytest.raises(ConnectionClosed):
                while True:
                    await asyncio.wait_for(ws.recv(), 10)
            return ws.close_code

    return asyncio.run(asyncio.wait_for(session(), 30))


def _on_loop(loop: asyncio.AbstractEventLoop | None, fn: Callable[[], Any]) -> None:
    assert loop is not None
    done = threading.Event()
    loop.call_soon_threadsafe(lambda: (fn(), done.set()))
    assert done.wait(5)


def test_the_wire_drains_the_tunnels_registry_its_tunnels_join(
    upstream: EchoUpstream, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """The wire's end-of-drain cut (`Wire.close`) reaches its tunnels through the registry
    of its TunnelContext, the one each tunnel joins as it begins: not a set of its own."""
    proxy = start_proxy(upstream.url.replace("ws://", "http://"))
    wire = proxy.app.wire
    assert wire is not None
    context: Any = wire.tunnel_context
    assert wire.tunnels is context.tunnels
    url = proxy.url.replace("http://", "ws://")
    code = _drained_session(url, context.tunnels, lambda: _on_loop(proxy.server.loop, wire.close))
    assert code == GOING_AWAY
    _wait(lambda: len(context.tunnels) == 0)


def test_the_listener_drains_through_the_same_registry(upstream: EchoUpstream) -> None:
    """The test listener's drain is the registry's `shutdown_all`, the one `Wire.close` runs."""
    listener = TunnelListener(upstream.url.replace("ws://", "http://")).start()
    try:
        assert listener.context is not None
        registry = listener.context.tunnels
        assert isinstance(registry, OpenTunnels)
        code = _drained_session(listener.url, registry, listener.shutdown_all)
        assert code == GOING_AWAY
        _wait(lambda: listener.open_tunnels() == 0)
    finally:
        listener.stop()


def test_a_tunnel_ending_during_the_drain_does_not_disturb_it() -> None:
    """`shutdown_all` walks a snapshot: a tunnel that leaves as it is shut down (one not yet
    open ends at once) leaves its neighbours drained too."""
    registry = OpenTunnels()
    drained: list[int] = []

    class Ends:
        def __init__(self, n: int) -> None:
            self.n = n

        def shutdown(self) -> None:
            drained.append(self.n)
            registry.discard(self)

    for n in range(3):
        registry.add(Ends(n))
    registry.shutdown_all()
    assert sorted(drained) == [0, 1, 2] and len(registry) == 0
