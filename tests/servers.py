"""Real servers on loopback for tests: an ASGI app on uvicorn, on an ephemeral port.

Each server runs its own event loop in a daemon thread, like a separate process would,
so a test's client traffic goes over real sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from proxy.bench.ports import free_port


class ThreadedServer:
    """uvicorn serving `app` on 127.0.0.1:<ephemeral> in a background thread."""

    def __init__(self, app: Any, **config: Any) -> None:
        self.port = free_port()
        options: dict[str, Any] = {"log_level": "warning", "lifespan": "on", "access_log": False}
        cfg = uvicorn.Config(app, host="127.0.0.1", port=self.port, **{**options, **config})
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.server.serve())
        finally:
            self.loop.close()

    def start(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server failed to start")
            time.sleep(0.005)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@contextlib.contextmanager
def serve(app: Any, **config: Any) -> Iterator[ThreadedServer]:
    server = ThreadedServer(app, **config).start()
    try:
        yield server
    finally:
        server.stop()
