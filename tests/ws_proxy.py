"""The tunnel on its own listener, for tests: a protocol that reads a request head and
hands a WebSocket upgrade to `proxy.server.tunnel.take_over`, as the wire does.

It runs in a daemon thread with its own event loop, with a fresh registry and the real
sinks; anything but a WebSocket upgrade gets a 400. `tokenprobe serve` tests use the wire
instead; this one lets the tunnel's own cases (backpressure, drain, idle) run in one
process with their metrics at hand.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from typing import Any, cast

from prometheus_client import CollectorRegistry, generate_latest

from proxy.bench.ports import free_port
from proxy.core.labels import ModelLabels
from proxy.core.wsseam import WsApi
from proxy.server.tunnel import TunnelContext, is_websocket_upgrade, take_over, tunnel_context
from proxy.settings import Settings
from proxy.sinks.dispatch import Sinks
from proxy.sinks.metrics import Metrics
from proxy.sinks.sink import Recorder
from tests.scrape import page, scrape
from tests.servers import WsLoopThread, spawn, stop, wait_http


class _Head(asyncio.Protocol):
    def __init__(self, context: TunnelContext) -> None:
        self.context = context
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head, rest = self.buffer[: end + 4], self.buffer[end + 4 :]
        lines = head.split(b"\r\n")
        method, _, remainder = lines[0].partition(b" ")
        request_target = remainder.rpartition(b" ")[0]
        headers = [
            (name.strip(), value.strip())
            for name, _, value in (line.partition(b":") for line in lines[1:] if line)
        ]
        if is_websocket_upgrade(method, headers):
            take_over(self.transport, method, request_target, headers, rest, self.context)
        else:
            self.transport.write(
                b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
            )
            self.transport.close()


class TunnelListener(WsLoopThread):
    """take_over behind a plain listener on 127.0.0.1:<free port>."""

    kind = "listener"
    what = "the tunnel listener"

    def __init__(
        self,
        upstream: str,
        apis: Callable[[str], WsApi | None] | None = None,
        **settings: Any,
    ) -> None:
        super().__init__()
        self.registry = CollectorRegistry()
        metrics = Metrics(self.registry)
        self.recorder = Recorder()
        self.sinks = Sinks([metrics, self.recorder], metrics=metrics, models=ModelLabels(()))
        self.settings = Settings(upstream=upstream, **settings)
        self.apis = apis
        self.context: TunnelContext | None = None
        self._stop: asyncio.Event | None = None

    async def _serve(self) -> None:
        context = tunnel_context(self.settings, self.sinks)
        if self.apis is not None:
            context.apis = self.apis
        self.context = context
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _Head(context), "127.0.0.1", self.port)
        self._stop = asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        server.close()

    def call(self, fn: Callable[[], Any]) -> None:
        """Run fn on the listener's loop (the tunnels live there)."""
        assert self.loop is not None
        self.loop.call_soon_threadsafe(fn)

    def shutdown_all(self) -> None:
        assert self.context is not None
        self.call(self.context.tunnels.shutdown_all)  # the drain Wire.close runs

    def open_tunnels(self) -> int:
        assert self.context is not None
        return len(self.context.tunnels)

    def sample(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def scrape(self) -> str:
        return generate_latest(self.registry).decode()

    def stop(self) -> None:
        if self.loop is not None and self._stop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=10)


class ServedProxy:
    """`tokenprobe serve` as a process in front of `upstream`, with the TunnelListener's
    test-facing methods (metrics are scraped from its /metrics)."""

    kind = "serve"

    def __init__(self, upstream: str, **settings: Any) -> None:
        self.port = free_port()
        args = ["serve", "--upstream", upstream, "--port", str(self.port)]
        args += ["--access-log", "off", "--models-refresh", "0"]
        for name, value in settings.items():
            args += ["--" + name.replace("_", "-"), str(value)]
        self.process = spawn(*args)
        self.base = f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def start(self) -> ServedProxy:
        wait_http(self.base + "/healthz")
        return self

    def scrape(self) -> str:
        return page(self.base)

    def sample(self, name: str, **labels: str) -> float:
        """The series with exactly these labels, as the listener's get_sample_value reads it."""
        return scrape(self.base).value(name, **labels)

    def open_tunnels(self) -> int:
        return int(scrape(self.base).total("tokenprobe_websocket_sessions_in_flight"))

    def shutdown_all(self) -> None:
        """SIGTERM: the drain sends every tunnel its close frames."""
        self.process.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        stop(self.process)
