"""The ASGI app, for any ASGI server: `hypercorn proxy.asgi:app`, `uvicorn proxy.asgi:app`.

It is tokenprobe's ASGI relay (proxy/server/forward.py) beside the control plane, as
`tokenprobe serve --relay asgi` runs it, configured from the TOKENPROBE_* variables (the
settings table in the README; TOKENPROBE_UPSTREAM is required). The app is built at the
first message its server sends (the lifespan's startup), so importing this module reads
nothing. `create_app()` is the same as a factory (`uvicorn --factory proxy.asgi:create_app`).

Under another server, what `tokenprobe serve` adds around the app is that server's
business: its own head limits and timeouts (tokenprobe's admission still answers 431,
413 and 408), workers (use one process per metrics registry, or PROMETHEUS_MULTIPROC_DIR
as `--workers` does) and WebSockets (refused here with a 403: only the wire tunnels them).
"""

from __future__ import annotations

from proxy.server.app import ProxyApp
from proxy.server.serve import app_from_environment
from proxy.types import Receive, Scope, Send


def create_app() -> ProxyApp:
    """The ASGI app from the TOKENPROBE_* variables; raises SettingsError naming a bad one."""
    return app_from_environment()


class _App:
    """Builds the app at its first message, then is it."""

    def __init__(self) -> None:
        self.app: ProxyApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.app is None:
            self.app = create_app()
        await self.app(scope, receive, send)


app = _App()

__all__ = ["app", "create_app"]
