"""ProxyApp: the proxy's ASGI app, the relay beside the control plane.

Routes: the proxy's own (proxy/server/control.py) are `/healthz` (the process is up),
`/readyz` (the upstream answers) and `/metrics` and `/ui` while metrics are served on the
proxy's port (vLLM's own `/metrics`, and every path its mount answers, `/metrics<any>`, is
then shadowed: scrape vLLM directly). Every other
path is forwarded to the backend byte for byte; POSTs to a path with an API seam
(proxy/core/apis/) are measured. On the wire (proxy/server/wire/) only the control
paths reach this app; the wire reads its shared state from `wire`. The lifespan owns the
upstream client, the wire's pool, the model-list refresher and the tokenizer.
proxy/server/assemble.py builds the app from settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from contextvars import ContextVar
from typing import Any

import httpx
import orjson
from prometheus_client import CollectorRegistry

from proxy.core.errors import describe
from proxy.core.identity import IGNORES_MODEL_NAMES
from proxy.core.paths import route_key
from proxy.core.tokens import TokenCounter
from proxy.core.uvicorn_logs import keep_queries_out_of_logs
from proxy.server.admission import Refused, error_answer, own_route, where_to
from proxy.server.certwatch import WATCH
from proxy.server.control import ControlPlane, served_as
from proxy.server.forward import Forwarder, UpstreamBroke
from proxy.server.heap import freeze_startup_heap
from proxy.server.identity import keep_asking
from proxy.server.looplag import LoopLag
from proxy.server.protocol import ABANDONED, HEAD_GUARD, GuardedHttpToolsProtocol, HeadGuard
from proxy.server.tunnel import TunnelContext, tunnel_context
from proxy.server.upstream import create_client
from proxy.server.wire import WIRE_STATE, Wire
from proxy.server.wire_logs import keep_wire_libraries_quiet
from proxy.settings import Settings
from proxy.sinks.dispatch import Sinks
from proxy.sinks.sink import HeldBackSink
from proxy.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("tokenprobe")


class _HideUpstreamBroke(logging.Filter):
    """An UpstreamBroke is how the proxy asks uvicorn to drop a client connection after
    the upstream broke mid-stream; it is expected and already measured, not a crash."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, UpstreamBroke)


#: True in the --metrics-port listener's task, and what it starts (contexts are copied): the
#: log records logged there are its server's, not the main one's.
_IN_METRICS_LISTENER: ContextVar[bool] = ContextVar("in_metrics_listener", default=False)


class _MetricsListenerQuiet(logging.Filter):
    """The --metrics-port listener is a second uvicorn server on the main one's logger
    (`uvicorn.error`, whose level is the process's): its startup and shutdown lines would
    repeat the main server's, so they are dropped, and what it warns of says whose it is.
    (A level of its own would be the shared logger's, hiding the main server's lines.)"""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _IN_METRICS_LISTENER.get():
            return True
        if record.levelno < logging.WARNING:
            return False
        record.msg = "--metrics-port listener: " + str(record.msg)
        return True


logging.getLogger("uvicorn.error").addFilter(_HideUpstreamBroke())
logging.getLogger("uvicorn.error").addFilter(_MetricsListenerQuiet())
keep_queries_out_of_logs()  # no credential of a query in uvicorn's own lines
keep_wire_libraries_quiet()  # no header value nor query from them, at any --log-level


class ProxyApp:
    """The relay and the control plane side by side, built elsewhere (proxy/server/assemble.py):
    this class routes, and owns what lives as long as the server (the upstream client,
    the tokenizer, the model-list refresher, the --metrics-port listener)."""

    def __init__(
        self,
        settings: Settings,
        *,
        registry: CollectorRegistry,
        sinks: Sinks,
        control: ControlPlane,
        head_guard: HeadGuard,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """`head_guard`: the request-head limits its server's connections enforce;
        `transport`: the ASGI relay's way upstream instead of --upstream-transport's."""
        self.settings = settings
        self.head_guard = head_guard
        self.transport = transport
        self.upstream = settings.upstream
        self.registry = registry
        self.sinks = sinks
        self.control = control
        # Only a serving process's own app freezes its heap (serve.build_app): the test
        # processes build many apps and would keep every earlier one's garbage for good.
        self.freeze_heap = False
        self.client: httpx.AsyncClient | None = None
        self.forwarder: Forwarder | None = None
        self.wire: Wire | None = None  # the wire's shared state (proxy/server/wire/)
        self.counter: TokenCounter | None = None
        self._refresher: asyncio.Task[None] | None = None
        self._identity: asyncio.Task[None] | None = None  # asks what the backend is
        self._cert_watch: asyncio.Task[None] | None = None  # --enable-ssl-refresh
        self._metrics_server: Any = None
        self._metrics_task: asyncio.Task[None] | None = None
        self.loop_lag = LoopLag(sinks.metrics.loop_lag.observe)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "websocket":
            # Only the wire tunnels WebSockets; here a clean refusal (403), not a 500.
            # %r: the path is the client's, percent-decoded (a %0A would start a line)
            log.warning("WebSocket %r refused: the ASGI relay does not tunnel them", scope["path"])
            await send({"type": "websocket.close", "code": 1008})
        elif kind == "http":
            # The proxy's own routes first, decided on the normalised target (so no
            # spelling of /metrics reaches the backend); everything else belongs to the
            # backend, and goes to the relay with no router or middleware in between.
            raw_path = scope.get("raw_path") or scope["path"].encode()
            # parsed once, query and all: the relay's rules take the same target
            where = where_to(raw_path, scope["query_string"])
            own = own_route(where, self.control.owns)
            if own is not None and not isinstance(where, Refused):
                own = served_as(own, where.path)  # `/ui/.`: the redirect to /ui
                await self.control({**scope, "path": own, "raw_path": own.encode()}, receive, send)
            else:
                assert self.forwarder is not None, "lifespan did not run"
                await self.forwarder(scope, receive, send, where)
        elif kind == "lifespan":
            await self._lifespan(scope, receive, send)

    # -- lifespan ---------------------------------------------------------------------

    async def startup(self) -> None:
        settings = self.settings
        self.client = create_client(
            settings, self.transport, self.sinks.count_upstream_protocol_error
        )
        if settings.tokenizer:
            self.counter = TokenCounter(settings.tokenizer)
        self.forwarder = Forwarder.from_settings(
            settings, client=self.client, sinks=self.sinks, counter=self.counter
        )
        self.wire = Wire(self.forwarder.context, self.control.owns, _tunnel_context(self))
        self.control.readiness.client = self.client
        self.loop_lag.start()
        if settings.models_refresh:
            self._refresher = asyncio.create_task(self._refresh_models(settings.models_refresh))
            self._identity = asyncio.create_task(
                keep_asking(self.client, self.upstream, settings.models_refresh, self._backend)
            )
        if settings.enable_ssl_refresh:
            self._cert_watch = asyncio.create_task(WATCH.run(self.sinks.metrics.tls_reloads.inc))
        if self.control.listener is not None and settings.metrics_port is not None:
            await self._start_metrics_listener(
                self.control.listener, settings.metrics_host or settings.host, settings.metrics_port
            )
        if self.freeze_heap:
            freeze_startup_heap()

    async def _start_metrics_listener(self, app: ASGIApp, host: str, port: int) -> None:
        """/metrics on its own address, so it can stay off the network clients reach.

        It shares this process and loop with the relay, so its connections get the relay's
        limits: the head guard's protocol and limits (proxy/server/protocol.py: a head over
        --max-header-bytes is cut as it arrives, one not in within --header-timeout is
        closed), handed to it as the main server's are (`MetricsListener`'s lifespan), the
        keep-alive timeout, and a bound on the requests served at once. It runs on the
        main server's loop (made by proxy/server/eventloop.py) and serves no TLS."""
        import uvicorn

        config = uvicorn.Config(
            MetricsListener(app, self.head_guard),
            host=host,
            port=port,
            http=GuardedHttpToolsProtocol,
            lifespan="on",  # hands the head guard over (MetricsListener)
            access_log=False,
            # neither uvicorn's logging config nor a level: either would be set again on
            # the loggers the main server shares (a level there hid its INFO lines), and
            # the main server configured them already; _MetricsListenerQuiet sorts its lines
            log_config=None,
            # uvicorn's call_later takes a float, as the main server's options hand it
            timeout_keep_alive=self.settings.keep_alive_timeout,  # type: ignore[arg-type]
            server_header=False,
            date_header=False,
            proxy_headers=False,  # nothing here reads the client's address
        )
        server = uvicorn.Server(config)
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]  # the main server owns signals
        self._metrics_server = server
        marked = _IN_METRICS_LISTENER.set(True)  # binding logs too ("Uvicorn running on")
        try:  # bound here: uvicorn answers a failed bind with sys.exit, out of a task
            sock = config.bind_socket()  # (a traceback through the event loop, exit 3)
        except SystemExit:  # it logged why (the address in use, ...)
            raise RuntimeError(f"--metrics-port {port}: cannot listen on {host}:{port}") from None
        finally:
            _IN_METRICS_LISTENER.reset(marked)
        self._metrics_task = asyncio.create_task(_serve_listener(server, sock))
        while not server.started:
            if self._metrics_task.done():
                self._metrics_task.result()  # raises what failed
                raise RuntimeError(f"metrics listener on {host}:{port} did not start")
            await asyncio.sleep(0.01)

    async def shutdown(self) -> None:
        if self.wire is not None:  # the drain is over: cut what is still in flight
            self.wire.close()
        await self.loop_lag.stop()
        if self._metrics_server is not None and self._metrics_task is not None:
            self._metrics_server.should_exit = True
            await self._metrics_task
        for task in (self._refresher, self._identity, self._cert_watch):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.client is not None:
            await self.client.aclose()
        if self.counter is not None:
            self.counter.close()
        if self.sinks.tracer is not None:
            await asyncio.to_thread(self.sinks.tracer.shutdown)  # flush queued spans
        for sink in self.sinks.sinks:
            # Here, not only at exit: a worker process of `--workers` is ended by the
            # SIGTERM uvicorn raises again after its shutdown, before any exit handler.
            if isinstance(sink, HeldBackSink):
                await asyncio.to_thread(sink.shutdown)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    # ASGI sends no shutdown after a failed start: end what it began (the
                    # model-list refresher, its connection half made, was left to the loop's
                    # close: "coroutine ... was never awaited" after a --metrics-port in use).
                    # What failed is told below; ending a half-made start may fail too.
                    with contextlib.suppress(Exception):
                        await self.shutdown()
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                # Handed to the server's protocols: uvicorn gives each connection this
                # state (its `app_state`), so the wire and the head limits are this app's.
                state = scope.get("state")
                if state is not None:
                    state[WIRE_STATE] = self.wire
                    state[HEAD_GUARD] = self.head_guard
                    if self.forwarder is not None:
                        state[ABANDONED] = self.forwarder.abandoned
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

    def _backend(self, kind: str, version: str) -> None:
        """What the upstream said it is: for the data paths (admission) and the metrics."""
        assert self.forwarder is not None
        backend = self.forwarder.context.backend
        backend.kind, backend.version = kind, version
        self.sinks.metrics.set_backend(kind, version)
        self.sinks.models.names_ignored(kind in IGNORES_MODEL_NAMES)

    async def _refresh_models(self, every: float) -> None:
        """The upstream's model list every `every` seconds; after a failed lookup sooner
        (1 s, doubling up to `every`): a proxy started beside a vLLM still loading its
        model would otherwise label that model `other` for a whole --models-refresh
        (60 s by default) once vLLM is up."""
        retry = 1.0
        while True:
            ids = await self.fetch_models()
            if ids is not None:
                self.sinks.models.update_from_upstream(ids)
                retry = 1.0
                await asyncio.sleep(every)
            else:
                await asyncio.sleep(min(retry, every))
                retry *= 2


#: The most requests the --metrics-port listener serves at once; past it, a 503
#: (`MetricsListener`). A few scrapers and live views use it. Requests, not connections:
#: uvicorn's `limit_concurrency` counts every open connection, so 64 heads left unfinished
#: (each cut only at --header-timeout, and sent again) kept every scrape at 503.
METRICS_CONCURRENCY = 64


class MetricsListener:
    """The --metrics-port listener's app: the control plane's routes there, matched on the
    normalised target as on the proxy's port (`//metrics` and `/metrics/` are /metrics,
    `/ui/.` the redirect to /ui), and a lifespan that hands its server's connections the
    head guard (`HEAD_GUARD` in uvicorn's `app_state`), as ProxyApp's does the main
    server's: without one, a connection's limits would be the defaults, not the settings."""

    def __init__(self, routes: ASGIApp, head_guard: HeadGuard) -> None:
        self.routes = routes
        self.head_guard = head_guard
        self.serving = 0  # requests in `routes` now (METRICS_CONCURRENCY)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            if self.serving >= METRICS_CONCURRENCY:
                await _busy(send)
                return
            raw_path = scope.get("raw_path") or scope["path"].encode()
            where = where_to(raw_path, scope["query_string"])
            if not isinstance(where, Refused):  # else the routes' 404
                own = served_as(route_key(where.path), where.path)
                scope = {**scope, "path": own, "raw_path": own.encode()}
            self.serving += 1
            try:
                await self.routes(scope, receive, send)
            finally:
                self.serving -= 1
        elif kind == "websocket":  # no route here takes one: a refusal, not an error
            await send({"type": "websocket.close", "code": 1008})
        elif kind == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    state = scope.get("state")
                    if state is not None:
                        state[HEAD_GUARD] = self.head_guard
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return


async def _busy(send: Send) -> None:
    """The listener's answer past METRICS_CONCURRENCY requests at once."""
    headers, body = error_answer(
        503, "busy", f"the metrics listener serves {METRICS_CONCURRENCY} requests at once", None
    )
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _serve_listener(server: Any, sock: Any) -> None:
    """The listener's server, its task's log records marked as its own (the variable is
    set in this task's copy of the context only)."""
    _IN_METRICS_LISTENER.set(True)
    await server.serve(sockets=[sock])


def _tunnel_context(app: ProxyApp) -> TunnelContext:
    """The WebSocket tunnel's context (proxy/server/tunnel/), built once per server."""
    return tunnel_context(app.settings, app.sinks)
