"""The control plane: the proxy's own routes, a Starlette router beside the relay.

`/healthz` (the process is up) and `/readyz` (the upstream answers) are always on the
proxy's port. `/metrics` and the live view (`/ui`, `/ui/<asset>`) are there too, unless
--metrics-port moves them to a listener of their own, which serves nothing else. Every
route answers any method, as the hand-written routes did. The relay never goes through
here: ProxyApp asks `owns(path)` and sends everything else straight to the forwarder.

While /metrics is here, every path that begins with `/metrics` is too: vLLM mounts its
exposition as `Mount("/metrics", make_asgi_app(...))` with `path_regex =
re.compile("^/metrics(?P<path>.*)$")` (vllm/entrypoints/serve/instrumentator/metrics.py,
`attach_router`), so `/metricsX`, `/metrics;x` or `/metrics/x` answer the backend's whole
exposition. Relayed, they would pass --metrics-token by; the proxy answers them a 404 of
its own instead (only `/metrics` itself is its exposition).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from time import monotonic

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route, Router, request_response

from proxy.core.errors import error_body
from proxy.types import ASGIApp, Message, Receive, Scope, Send
from proxy.ui import live_view

_LIVE_VIEW = "/ui"
_METRICS = "/metrics"


#: The most a readiness probe waits for the upstream's answer head, all in all.
PROBE_SECONDS = 2.0


class Readiness:
    """Ready when the upstream answers HTTP at all (a status below 500 within
    PROBE_SECONDS: its head is enough, the body is not read); cached for a second, and
    callers that come while a probe runs wait for that one, so any number of them asks
    the upstream once. The lifespan hands it the upstream client when it has made one."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.client: httpx.AsyncClient | None = None
        self._checked_at = -1e9
        self._ready = False
        self._probe: asyncio.Task[bool] | None = None

    async def __call__(self) -> bool:
        if monotonic() - self._checked_at < 1.0:
            return self._ready
        if self._probe is None:
            self._probe = asyncio.ensure_future(self._ask())
            self._probe.add_done_callback(self._probed)
        return await asyncio.shield(self._probe)

    async def _ask(self) -> bool:
        assert self.client is not None, "lifespan did not run"
        try:
            async with asyncio.timeout(PROBE_SECONDS):
                request = self.client.build_request("GET", self.upstream + "/v1/models")
                response = await self.client.send(request, stream=True)
                await response.aclose()
                return response.status_code < 500
        except (httpx.HTTPError, TimeoutError):
            return False

    def _probed(self, probe: asyncio.Task[bool]) -> None:
        self._probe = None
        self._ready = not probe.cancelled() and probe.exception() is None and probe.result()
        self._checked_at = monotonic()


class GuardedMetrics:
    """/metrics behind --metrics-token when one is set (a bearer token, compared in
    constant time), else open."""

    def __init__(self, exposition: ASGIApp, token: str | None) -> None:
        self.exposition = exposition
        self.expected = None if token is None else token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is not None:
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.strip().partition(b" ")
            # the scheme in any case (RFC 9110 §11.1), the token compared in constant time
            bearer = scheme.lower() == b"bearer"
            if not (secrets.compare_digest(token.strip(), self.expected) and bearer):
                refuse = _error(401, "auth", "metrics need a bearer token")
                await refuse(scope, receive, _challenging(send))
                return
        await self.exposition(scope, receive, send)


class ControlPlane:
    """The routes on the proxy's port, and the --metrics-port listener's app if any."""

    def __init__(self, metrics: GuardedMetrics, readiness: Readiness, *, apart: bool) -> None:
        self.readiness = readiness
        observing: list[BaseRoute] = [
            Route(_METRICS, metrics),
            Route(_LIVE_VIEW, _AnyMethod(live_view)),
            Route(_LIVE_VIEW + "/{asset:path}", _AnyMethod(live_view)),
        ]
        probes: list[BaseRoute] = [
            Route("/healthz", _AnyMethod(_healthz)),
            Route("/readyz", _AnyMethod(self._readyz)),
        ]
        here = probes if apart else [*probes, *observing]
        # what the proxy owns and has no route for (`/metricsX`): its 404, never relayed
        unknown = _error(404, "not_found", "no such route of the proxy's")
        self.router = Router(here, redirect_slashes=False, default=unknown)
        self.paths = frozenset(
            ("/healthz", "/readyz") if apart else ("/healthz", "/readyz", _METRICS, _LIVE_VIEW)
        )
        # /metrics with no slash: the backend's mount serves `/metrics<anything>`
        self.prefixes = () if apart else (_LIVE_VIEW + "/", _METRICS)
        self.listener: Router | None = None
        if apart:
            elsewhere = _error(404, "not_found", "only /metrics and /ui are served here")
            self.listener = Router(observing, redirect_slashes=False, default=elsewhere)

    def owns(self, path: str) -> bool:
        """Whether a path (a `route_key`) is the proxy's own; every other one is the
        backend's."""
        return path in self.paths or path.startswith(self.prefixes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.router(scope, receive, send)

    async def _readyz(self, request: Request) -> Response:
        # Not the upstream's address: anyone who reaches the port may ask (the operator
        # has it in their settings).
        ready = await self.readiness()
        return JSONResponse({"ready": ready}, 200 if ready else 503)


def served_as(key: str, path: str) -> str:
    """The route a request for the own route `key` (its `route_key`) is served as, `path`
    its normalised path. The live view's page asked by any spelling but `/ui` itself
    (`/ui/`, `/ui/.`, `//ui`) gets the redirect to /ui (the `/ui/` route), for its assets
    are relative: served at `/ui/.`, `ui/app.js` resolved to /ui/ui/app.js, a 404."""
    return _LIVE_VIEW + "/" if key == _LIVE_VIEW and path != _LIVE_VIEW else key


class _AnyMethod:
    """A request -> response endpoint for every method: Starlette routes a bare function
    for GET and HEAD only, and an ASGI object for all."""

    def __init__(self, endpoint: Callable[[Request], Awaitable[Response] | Response]) -> None:
        self.app = request_response(endpoint)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


async def _healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


def _error(status: int, kind: str, message: str) -> Response:
    return Response(error_body(status, kind, message), status, media_type="application/json")


def _challenging(send: Send) -> Send:
    """`send` with `WWW-Authenticate: Bearer` added to the response head (RFC 9110 §15.5.2:
    a 401 says which scheme it wants)."""

    async def with_challenge(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [*message.get("headers", ()), (b"www-authenticate", b"Bearer")]
            message = {**message, "headers": headers}
        await send(message)

    return with_challenge
