"""The simulated vLLM server as a pure ASGI app: routes, auth, one record per request.

  GET  /v1/models            vLLM's model list
  POST /v1/chat/completions  streamed or not (see stream.py, controls.py)
  POST /v1/completions       streamed or not
  POST /v1/embeddings        tiny deterministic vectors
  GET  /health               200, empty body
  GET  /sim/requests         the records as JSON (authorization masked)
  GET  /sim/stats            load counters (active, max_active, total, lockstep ticks)
  POST /sim/reset            forget the records

/v1 requests are recorded in `app.state`; /health and /sim/* are not.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.types import Receive, Scope, Send

from proxy.sim import catalog, errors
from proxy.sim.config import SimConfig
from proxy.sim.controls import Kind, plan_request, stall_before_headers
from proxy.sim.exchange import Exchange
from proxy.sim.pacing import FreePacer, LockstepPacer, Pacer, StepClock
from proxy.sim.state import Outcome, SimRequest, SimState
from proxy.sim.stream import complete, stream
from proxy.sim.wire import StreamWire

Handler = Callable[["SimApp", Exchange, Any, float], Awaitable[Outcome]]


def create_sim_app(config: SimConfig, state: SimState | None = None) -> SimApp:
    return SimApp(config, state)


class SimApp:
    def __init__(self, config: SimConfig, state: SimState | None = None) -> None:
        self.config = config
        self.state = state if state is not None else SimState(max_records=config.max_records)
        self.clock = StepClock(config.step_ms / 1000) if config.step_ms else None
        self._models = catalog.models_list(config)
        self._auth = None if config.api_key is None else f"Bearer {config.api_key}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if scope["path"].startswith("/v1/"):
                await self._api(scope, receive, send)
            else:
                await self._admin(scope, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    # -- /v1 -----------------------------------------------------------------

    async def _api(self, scope: Scope, receive: Receive, send: Send) -> None:
        t0 = asyncio.get_running_loop().time()
        path: str = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        record = SimRequest(
            id=_response_id(path, headers),
            path=path,
            method=scope["method"],
            headers=headers,
            body=None,
            started=time.monotonic(),
        )
        self.state.begin(record)
        ex = Exchange(receive, send, record, self.state, self.config.record_bodies)
        outcome: Outcome = "error"
        try:
            raw = await ex.read_body()
            if raw is None:
                record.aborted_at = time.monotonic()
                outcome = "aborted"
                return
            body, bad_json = _parse_json(raw)
            record.body = body
            outcome = await ex.guard(lambda: self._route(ex, bad_json, t0))
        finally:
            ex.finish(outcome)  # a no-op when the response already ended

    async def _route(self, ex: Exchange, bad_json: str | None, t0: float) -> Outcome:
        record = ex.record
        stall = stall_before_headers(record.headers)
        if stall > 0:
            await asyncio.sleep(stall)
        if self._auth is not None and record.headers.get("authorization") != self._auth:
            await ex.error(errors.unauthorized())
            return "error"
        route = _ROUTES.get(record.path)
        if route is None:
            await ex.error(errors.route_not_found())
            return "error"
        method, handler = route
        if record.method != method:
            await ex.error(errors.method_not_allowed())
            return "error"
        if bad_json is not None:
            await ex.error(errors.bad_request(f"JSON decode error: {bad_json}"))
            return "error"
        return await handler(self, ex, record.body, t0)

    async def _models_list(self, ex: Exchange, body: Any, t0: float) -> Outcome:
        await ex.reply(200, self._models)
        return "completed"

    async def _chat(self, ex: Exchange, body: Any, t0: float) -> Outcome:
        return await self._generate("chat", ex, body, t0)

    async def _completion(self, ex: Exchange, body: Any, t0: float) -> Outcome:
        return await self._generate("completion", ex, body, t0)

    async def _generate(self, kind: Kind, ex: Exchange, body: Any, t0: float) -> Outcome:
        record = ex.record
        plan = plan_request(kind, body, record.headers, self.config)
        if isinstance(plan, errors.ErrorReply):
            await ex.error(plan)
            return "error"
        record.model, record.stream, record.prompt_tokens = (
            plan.model,
            plan.stream,
            plan.prompt_tokens,
        )
        pacer: Pacer
        if self.clock is not None:
            pacer = LockstepPacer(self.clock, t0, plan.ttft)
        else:
            pacer = FreePacer(t0, plan.ttft, plan.tokens_per_chunk / plan.tokens_per_second)
        created = int(time.time())
        if not plan.stream:
            return await complete(ex, plan, pacer, record.id, created)
        stamp = self.config.stamp or record.headers.get("x-sim-stamp", "0") in ("1", "true")
        sse = StreamWire(kind == "chat", record.id, created, plan.model, stamp)
        return await stream(ex, plan, sse, pacer)

    async def _embeddings(self, ex: Exchange, body: Any, t0: float) -> Outcome:
        if not isinstance(body, dict) or body.get("input") is None:
            await ex.error(errors.bad_request("Field required: input"))
            return "error"
        model = str(body.get("model") or self.config.models[0])
        if model not in self.config.models:
            await ex.error(errors.model_not_found(model))
            return "error"
        ex.record.model = model
        await ex.reply(200, catalog.embeddings(ex.record.id, model, body))
        return "completed"

    # -- everything else -----------------------------------------------------

    def stats(self) -> dict[str, int | float | None]:
        """Load counters; in lockstep mode also the ticks, and how many fired a step late."""
        clock = self.clock
        return {
            "active": self.state.active,
            "max_active": self.state.max_active,
            "total": self.state.total,
            "step_ms": None if clock is None else clock.step * 1000,
            "ticks": None if clock is None else clock.fired,
            "late_ticks": None if clock is None else clock.late,
        }

    async def _admin(self, scope: Scope, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        status, body = 404, b'{"detail":"Not Found"}'
        if path == "/health" and method == "GET":
            status, body = 200, b""
        elif path == "/sim/requests" and method == "GET":
            status, body = 200, orjson.dumps([r.to_json() for r in self.state.requests()])
        elif path == "/sim/stats" and method == "GET":
            status, body = 200, orjson.dumps(self.stats())
        elif path == "/sim/reset" and method == "POST":
            self.state.reset()
            status, body = 200, b'{"reset":true}'
        headers = [(b"content-length", b"%d" % len(body))]
        if body:
            headers.append((b"content-type", b"application/json"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.clock is not None:
                    self.clock.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


_ROUTES: dict[str, tuple[str, Handler]] = {
    "/v1/models": ("GET", SimApp._models_list),
    "/v1/chat/completions": ("POST", SimApp._chat),
    "/v1/completions": ("POST", SimApp._completion),
    "/v1/embeddings": ("POST", SimApp._embeddings),
}

_ID_PREFIX = {
    "/v1/chat/completions": "chatcmpl-",
    "/v1/completions": "cmpl-",
    "/v1/embeddings": "embd-",
}


def _parse_json(raw: bytes) -> tuple[Any, str | None]:
    """(the parsed body or None, why it is not JSON or None)."""
    if not raw:
        return None, None
    try:
        return orjson.loads(raw), None
    except orjson.JSONDecodeError as exc:
        return None, str(exc)


def _response_id(path: str, headers: dict[str, str]) -> str:
    # vLLM builds the id from the client's X-Request-Id when there is one.
    base = headers.get("x-request-id") or uuid.uuid4().hex
    return _ID_PREFIX.get(path, "req-") + base
