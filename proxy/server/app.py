"""create_app(settings) -> the proxy's ASGI app.

Routes: the proxy's own are `/healthz` (the process is up), `/readyz` (the upstream
answers) and `/metrics` while metrics are served on the proxy's port (vLLM's own
`/metrics` is then shadowed: scrape vLLM directly). Every other path is forwarded to the
backend byte for byte; POSTs to a path with an API seam (proxy/core/apis/) are measured.
The lifespan owns the upstream client, the model-list refresher and the tokenizer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable
from time import monotonic
from typing import Any

import httpx
import orjson
from prometheus_client import CollectorRegistry

from proxy.core.errors import error_body
from proxy.core.labels import ModelLabels
from proxy.core.measurement import Measurement
from proxy.core.tokens import TokenCounter
from proxy.server.exposition import Exposition
from proxy.server.forward import Forwarder, UpstreamBroke
from proxy.server.upstream import create_client, describe
from proxy.settings import Settings, require_upstream
from proxy.sinks.dispatch import RequestTracer, Sinks
from proxy.sinks.keys import KeyLabels
from proxy.sinks.metrics import Metrics
from proxy.types import Receive, Scope, Send
from proxy.ui import is_ui_path, serve_ui

log = logging.getLogger("tokenprobe")


class _HideUpstreamBroke(logging.Filter):
    """An UpstreamBroke is how the proxy asks uvicorn to drop a client connection after
    the upstream broke mid-stream; it is expected and already measured, not a crash."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, UpstreamBroke)


logging.getLogger("uvicorn.error").addFilter(_HideUpstreamBroke())


class ProxyApp:
    def __init__(
        self,
        settings: Settings,
        *,
        registry: CollectorRegistry | None = None,
        tracer: RequestTracer | None = None,
        consumers: list[Callable[[Measurement, str], None]] | None = None,
        metrics_app: Any = None,
    ) -> None:
        self.settings = settings
        self.upstream = require_upstream(settings)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = Metrics(self.registry)
        self.labels = ModelLabels(settings.model_allowlist)
        keys = KeyLabels(settings.key_salt) if settings.key_label == "hash" else None
        self.sinks = Sinks(
            self.metrics, self.labels, tracer=tracer, consumers=consumers or [], keys=keys
        )
        self.metrics_app = metrics_app or Exposition(self.registry)
        self.client: httpx.AsyncClient | None = None
        self.forwarder: Forwarder | None = None
        self.counter: TokenCounter | None = None
        self._refresher: asyncio.Task[None] | None = None
        self._metrics_server: Any = None
        self._metrics_task: asyncio.Task[None] | None = None
        self._ready_at = -1e9
        self._ready = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            path: str = scope["path"]
            # The proxy's own routes first; everything else belongs to the backend.
            if path == "/metrics" and self.settings.metrics_port is None:
                await self.serve_metrics(scope, receive, send)
            elif is_ui_path(path) and self.settings.metrics_port is None:
                await serve_ui(scope, receive, send)
            elif path == "/healthz":
                await _json(send, 200, {"status": "ok"})
            elif path == "/readyz":
                ready = await self._upstream_ready()
                await _json(
                    send, 200 if ready else 503, {"ready": ready, "upstream": self.upstream}
                )
            else:
                assert self.forwarder is not None, "lifespan did not run"
                await self.forwarder(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def serve_metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = self.settings.metrics_token
        if token is not None:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, b"Bearer " + token.encode()):
                await _error(send, 401, "auth", "metrics need a bearer token")
                return
        await self.metrics_app(scope, receive, send)

    # -- lifespan ---------------------------------------------------------------------

    async def startup(self) -> None:
        settings = self.settings
        self.client = create_client(settings)
        if settings.tokenizer:
            self.counter = TokenCounter(settings.tokenizer)
        self.forwarder = Forwarder.from_settings(
            settings, client=self.client, sinks=self.sinks, counter=self.counter
        )
        if settings.models_refresh:
            self._refresher = asyncio.create_task(self._refresh_models(settings.models_refresh))
        if settings.metrics_port is not None:
            await self._start_metrics_listener(
                settings.metrics_host or settings.host, settings.metrics_port
            )

    async def _start_metrics_listener(self, host: str, port: int) -> None:
        """/metrics on its own address, so it can stay off the network clients reach."""
        import uvicorn

        async def metrics_only(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                return
            if scope["path"] == "/metrics":
                await self.serve_metrics(scope, receive, send)
            elif is_ui_path(scope["path"]):
                await serve_ui(scope, receive, send)
            else:
                await _error(send, 404, "not_found", "only /metrics and /ui are served here")

        config = uvicorn.Config(
            metrics_only,
            host=host,
            port=port,
            lifespan="off",
            access_log=False,
            log_level="warning",
        )
        server = uvicorn.Server(config)
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]  # the main server owns signals
        self._metrics_server = server
        self._metrics_task = asyncio.create_task(server.serve())
        while not server.started:
            if self._metrics_task.done():
                self._metrics_task.result()  # raises what failed (e.g. port in use)
                raise RuntimeError(f"metrics listener on {host}:{port} did not start")
            await asyncio.sleep(0.01)

    async def shutdown(self) -> None:
        if self._metrics_server is not None and self._metrics_task is not None:
            self._metrics_server.should_exit = True
            await self._metrics_task
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        if self.client is not None:
            await self.client.aclose()
        if self.counter is not None:
            self.counter.close()
        if self.sinks.tracer is not None:
            await asyncio.to_thread(self.sinks.tracer.shutdown)  # flush queued spans

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- upstream checks --------------------------------------------------------------

    async def fetch_models(self) -> list[str] | None:
        assert self.client is not None
        try:
            response = await self.client.get(self.upstream + "/v1/models", timeout=5.0)
        except httpx.HTTPError as exc:
            log.warning("could not list upstream models: %s", describe(exc))
            return None
        if response.status_code != 200:
            log.warning(
                "upstream /v1/models answered %s; set --model-allowlist to label models",
                response.status_code,
            )
            return None
        try:
            data = orjson.loads(response.content)["data"]
            return [str(item["id"]) for item in data]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return None

    async def _refresh_models(self, every: float) -> None:
        while True:
            ids = await self.fetch_models()
            if ids is not None:
                self.labels.update_from_upstream(ids)
            await asyncio.sleep(every)

    async def _upstream_ready(self) -> bool:
        """Ready when the upstream answers HTTP at all; cached for a second."""
        if monotonic() - self._ready_at < 1.0:
            return self._ready
        assert self.client is not None
        try:
            response = await self.client.get(self.upstream + "/v1/models", timeout=2.0)
            self._ready = response.status_code < 500
        except httpx.HTTPError:
            self._ready = False
        self._ready_at = monotonic()
        return self._ready


def create_app(settings: Settings, **kwargs: Any) -> ProxyApp:
    return ProxyApp(settings, **kwargs)


async def _error(send: Send, status: int, kind: str, message: str) -> None:
    await _send(send, status, error_body(status, kind, message))


async def _json(send: Send, status: int, payload: object) -> None:
    await _send(send, status, orjson.dumps(payload))


async def _send(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
