"""The simulated vLLM server as a pure ASGI app: routes, auth, one record per request.

  GET  /v1/models                  vLLM's model list
  POST /v1/chat/completions        streamed or not (see stream.py, controls.py)
  POST /v1/completions             streamed or not
  POST /v1/messages                Anthropic Messages, streamed or not (messages.py)
  POST /v1/messages/count_tokens   {"input_tokens", ...}
  POST /v1/responses               OpenAI Responses, streamed or not (responses.py)
  POST /inference/v1/generate      vLLM's token-in/token-out generate (generate.py)
  POST /v1/audio/transcriptions /v1/audio/translations
                                   multipart forms, a programmed transcript (audio.py)
  POST /cohere/v2/chat             Cohere chat v2 events, streamed or not (cohere.py)
  POST /v1/embeddings              tiny deterministic vectors (raw float32 for "bytes")
  POST /pooling /score /v1/score /rerank /v1/rerank /v2/rerank /classify /v1/classify
                                   vLLM's pooling family (pooling.py)
  POST /tokenize /detokenize       (utility.py)
  GET|POST /ping, GET /version, GET /load, POST /invocations (SageMaker dispatch)
  POST /completion /completions    llama.cpp's native completion events (llamacpp_native.py;
                                   only with SimConfig.backend_kind llamacpp)
  GET  /props                      llama.cpp's, with build_info (only with SimConfig.backend_kind
                                   llamacpp, which also has no /version: llamacpp.py)
  POST /api/chat /api/generate    Ollama's native API, NDJSON or one body (ollama.py)
  POST /api/embed                 Ollama's embeddings; GET /api/version its version, GET|HEAD /
                                  "Ollama is running" (both only with SimConfig.ollama_version:
                                  a simulator playing Ollama)
  WS   /v1/realtime                realtime transcription sessions (realtime.py)
  GET  /health                     200, empty body
  GET  /sim/requests               the records as JSON (credentials masked: SimRequest.to_json)
  GET  /sim/stats                  load counters (active, max_active, total, lockstep ticks)
  POST /sim/reset                  forget the records

Every API route is recorded in `app.state`; /health and /sim/* are not. As in vLLM 0.32
(vllm/entrypoints/serve/middleware/authenticate.py AuthenticationMiddleware), the API
keys guard the paths under /v1, /v2, /inference and /cohere, every method but OPTIONS,
and are read from the Authorization header as vLLM reads it (`ApiKeys`); a WebSocket
upgrade there without one is answered an HTTP 401 (`_deny_upgrade`). Generation routes
take the x-sim-* controls of controls.py; the non-generative ones take x-sim-error,
x-sim-ttft (their latency, with x-sim-ttft-per-prompt-token) and
x-sim-stall-before-headers.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import parse_qsl

import orjson
from starlette.types import Receive, Scope, Send

from proxy.core.lax import lax_bool
from proxy.sim import (
    audio,
    background,
    batch_chat,
    catalog,
    errors,
    label_reads,
    llamacpp,
    llamacpp_native,
    ollama,
    pooling,
    utility,
)
from proxy.sim.agentic import (
    ChatScript,
    CohereScript,
    MessagesScript,
    ResponsesScript,
    stream_script,
)
from proxy.sim.cohere import CohereWire
from proxy.sim.config import SimConfig
from proxy.sim.controls import (
    REQUESTS,
    ControlError,
    Kind,
    Plan,
    number,
    plan_request,
    stall_before_headers,
)
from proxy.sim.events import complete_events, stream_events
from proxy.sim.exchange import Exchange
from proxy.sim.generate import GenerateWire, complete_generate, stream_generate
from proxy.sim.messages import MessagesWire
from proxy.sim.messages import count_tokens as messages_count_tokens
from proxy.sim.pacing import FreePacer, LockstepPacer, Pacer, StepClock
from proxy.sim.prefix_cache import PrefixCache
from proxy.sim.realtime import RealtimeSession
from proxy.sim.request_json import read_json
from proxy.sim.responses import ResponsesWire, invalid_previous_id
from proxy.sim.slots import Slots
from proxy.sim.state import Outcome, SimRequest, SimState
from proxy.sim.stream import complete, engine_metrics, paced_whole, stream
from proxy.sim.tokens import completion_text, count_prompt_tokens
from proxy.sim.wire import StreamWire, stamp_mode

Handler = Callable[["SimApp", Exchange, Any, float], Awaitable[Outcome]]


def create_sim_app(config: SimConfig, state: SimState | None = None) -> SimApp:
    return SimApp(config, state)


class SimApp:
    def __init__(self, config: SimConfig, state: SimState | None = None) -> None:
        self.config = config
        self.state = state if state is not None else SimState(max_records=config.max_records)
        self.clock = StepClock(config.step_ms / 1000) if config.step_ms else None
        #: vLLM's --max-num-seqs: a request waits here for its `n` slots (its queue time).
        self.slots = Slots(config.max_num_seqs) if config.max_num_seqs else None
        self._models = catalog.models_list(config)
        keys = config.api_keys()
        self._keys = ApiKeys(keys) if keys else None  # None: every request passes
        self.realtime_sessions: list[RealtimeSession] = []  # what each one sent, for tests
        self.prefix_cache = (
            PrefixCache(config.prefix_cache, config.prefix_cache_block)
            if config.prefix_cache
            else None
        )
        self.loaded_models: set[str] = set()  # Ollama: models loaded by an earlier request
        self.background = background.BackgroundStore()  # background Responses' events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            if path in _ROUTES or path.startswith("/v1/") or self._ollama_root_path(path):
                await self._api(scope, receive, send)
            else:
                await self._admin(scope, send)
        elif scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        if not self._admits(scope):
            # vLLM's AuthenticationMiddleware guards upgrades as it guards requests,
            # before any route: an upgrade under its prefixes without the key gets its
            # JSONResponse, which starlette sends as the WebSocket Denial Response (an
            # HTTP 401, {"error":"Unauthorized"}): vllm/entrypoints/serve/middleware/
            # authenticate.py __call__, checked against vLLM 0.32 under uvicorn.
            await _deny_upgrade(scope, send, errors.unauthorized())
            return
        if path != "/v1/realtime":
            await send({"type": "websocket.close", "code": 1008})  # uvicorn answers 403
            return
        try:
            session = RealtimeSession(scope, receive, send, self.config)
        except ControlError:
            await send({"type": "websocket.close", "code": 1008})
            return
        self.realtime_sessions.append(session)
        await session.run()

    def _admits(self, scope: Scope) -> bool:
        """Whether vLLM's --api-key lets the request or upgrade through: OPTIONS and paths
        outside its prefixes always (authenticate.py AuthenticationMiddleware.__call__)."""
        return (
            self._keys is None
            or scope.get("method") == "OPTIONS"
            or not _guarded(scope["path"])
            or self._keys.admit(scope["headers"])
        )

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
            if path in _FORMS:
                body, bad_body = _parse_form(raw, headers.get("content-type", ""))
            else:
                body, bad_body = read_json(raw)
            if not raw and record.method == "GET" and scope["query_string"]:
                # a GET's arguments are its query (vLLM's retrieval of a Response takes
                # `stream` and `starting_after` as query parameters)
                body = dict(parse_qsl(scope["query_string"].decode("latin-1")))
            record.body = body
            admitted = self._admits(scope)
            outcome = await ex.guard(lambda: self._route(ex, bad_body, t0, admitted))
        finally:
            ex.finish(outcome)  # a no-op when the response already ended

    async def _route(
        self, ex: Exchange, bad_body: str | None, t0: float, admitted: bool
    ) -> Outcome:
        record = ex.record
        stall = stall_before_headers(record.headers)
        if stall > 0:
            await asyncio.sleep(stall)
        if not admitted:
            await ex.error(errors.unauthorized())
            return "error"
        route = _ROUTES.get(record.path) or _item_route(record.path)
        if route is None and self._ollama_root_path(record.path):
            route = _OLLAMA_ROOT
        if route is None:
            await ex.error(errors.route_not_found())
            return "error"
        methods, handler = route
        if record.method not in methods:
            await ex.error(errors.method_not_allowed())
            return "error"
        if bad_body is not None:
            await ex.error(errors.bad_request(bad_body))
            return "error"
        return await handler(self, ex, record.body, t0)

    async def _models_list(self, ex: Exchange, body: Any, t0: float) -> Outcome:
        await ex.reply(200, self._models)
        return "completed"

    async def _generate(
        self,
        kind: Kind,
        ex: Exchange,
        body: Any,
        t0: float,
        metrics: bool = True,
        planned: Plan | None = None,
    ) -> Outcome:
        """`metrics` False: never the per-request `metrics` object (batch chat's is null);
        `planned` the request's plan when its route already made it."""
        record = ex.record
        plan = plan_request(kind, body, record.headers, self.config) if planned is None else planned
        if isinstance(plan, errors.ErrorReply):
            await ex.error(plan)
            return "error"
        if not metrics and plan.metrics:
            plan = replace(plan, metrics=False)
        if (
            self.prefix_cache is not None
            and plan.cached_tokens is None
            and isinstance(body, dict)
            and not llamacpp.no_cache(plan, body)
        ):
            cached = self.prefix_cache.cached_tokens(body)
            plan = replace(plan, cached_tokens=min(cached, plan.prompt_tokens))
        record.model, record.stream, record.prompt_tokens = (
            plan.model,
            plan.stream,
            plan.prompt_tokens,
        )
        ollama_body = body if REQUESTS[kind].ollama and isinstance(body, dict) else None
        if ollama_body is not None:
            unload = ollama.unload_only(ollama_body, chat=kind == "ollama-chat")
            t0 = await self._load_model(ex, plan.model, loads=not unload)
        try:
            record.queued_at = time.monotonic()
            if self.slots is None:
                return await self._run(kind, ex, body, t0, plan)
            async with self.slots.hold(plan.n):
                record.scheduled_at = time.monotonic()
                return await self._run(kind, ex, body, asyncio.get_running_loop().time(), plan)
        finally:
            if ollama_body is not None and ollama.unloads(ollama_body.get("keep_alive")):
                # keep_alive 0: the runner expires once its request is done (server/sched.go
                # processCompleted: refCount 0 and sessionDuration <= 0 go to expiredCh); the
                # next request loads it again. (Ollama waits for every request on the runner;
                # the simulator forgets the model at the end of this one.)
                self.loaded_models.discard(plan.model)

    async def _load_model(self, ex: Exchange, model: str, loads: bool = True) -> float:
        """Ollama: a model not loaded yet first loads (its load time, `x-sim-load-time` or
        SimConfig.ollama_load_time); returns the loop time its TTFT then starts from.
        `loads` False: an unload request (proxy/sim/ollama.py unload_only) loads nothing and
        forgets the model at once (server/routes.go: s.sched.expireRunner(m), before any
        scheduleRunner)."""
        loop = asyncio.get_running_loop()
        record = ex.record
        if not loads:
            self.loaded_models.discard(model)
            record.loaded_at = time.monotonic()
            return loop.time()
        load = number(record.headers, "x-sim-load-time", float, -1.0, -1.0)
        if load < 0:
            load = 0.0 if model in self.loaded_models else self.config.ollama_load_time
        if load > 0:
            await asyncio.sleep(load)
        self.loaded_models.add(model)
        record.loaded_at = time.monotonic()
        return loop.time()

    async def _ollama_embed(self, ex: Exchange, body: Any, t0: float) -> Outcome:
        """/api/embed (server/routes.go EmbedHandler): `input` a string or a list of them."""
        record = ex.record
        texts = ollama.embed_inputs(body)
        if texts is None:
            await ex.error(ollama.error_reply(400, "invalid input type"))
            return "error"
        model = str(body.get("model") or "")
        record.model = model
        if model not in self.config.models:
            await ex.error(ollama.error_reply(404, f"model '{model}' not found"))
            return "error"
        tokens = sum(max(1, -(-len(t) // 4)) for t in texts)
        record.prompt_tokens = tokens
        if body.get("truncate") is False and tokens > self.config.max_model_len:
            await ex.error(ollama.error_reply(400, errors.OLLAMA_EMBED_CONTEXT))
            return "error"
        timer = ollama.Timer(int(record.started * 1e9))
        await self._load_model(ex, model)
        if not texts:  # the model loaded (scheduleRunner comes first), nothing to embed
            await ex.reply(200, ollama.no_embeddings(model), errors.OLLAMA_JSON)
            return "completed"
        assert record.loaded_at is not None
        timer.loaded = int(record.loaded_at * 1e9)
        ttft = number(record.headers, "x-sim-ttft", float, self.config.ttft, 0.0)
        await asyncio.sleep(ttft)
        record.first_token_at = time.monotonic()
        await ex.reply(200, ollama.embed(model, texts, timer, tokens), errors.OLLAMA_JSON)
        return "completed"

    async def _llamacpp_completion(self, ex: Exchange, body: Any, t0: float) -> Outcome:
        # llama-server's native /completion (and /completions): only a simulator playing it
        if ex.record.headers.get("x-sim-backend-kind", self.config.backend_kind) != "llamacpp":
            await ex.error(errors.route_not_found())
            return "error"
        return await self._generate("llamacpp-completion", ex, body, t0)

    async def _ollama_version(self, ex: Exchange, body: Any, t0: float) -> Outcome:
        # Only a simulator that plays Ollama says so (vLLM has no /api/version): what a
        # backend identifies as decides tokenprobe_backend_info.
        if self.config.ollama_version is None:
            await ex.error(errors.route_not_found())
            return "error"
        await ex.reply(200, ollama.version(self.config.ollama_version), errors.OLLAMA_JSON)
        return "completed"

    def _ollama_root_path(self, path: str) -> bool:
        """`/` of a simulator playing Ollama; vLLM has no `/` (its 404, any method)."""
        return path == "/" and self.config.ollama_version is not None

    async def _ollama_root(self, ex: Exchange, body: Any, t0: float) -> Outcome:
        # Ollama's `GET /` and `HEAD /` (server/routes.go GenerateRoutes: c.String(200,
        # "Ollama is running")): the Ollama CLI's first request (HEAD /) checks the server.
        await ex.reply(200, ollama.RUNNING, ollama.TEXT)
        return "completed"

    async def _run(self, kind: Kind, ex: Exchange, body: Any, t0: float, plan: Plan) -> Outcome:
        """Generate once scheduled: `t0` is when the request's TTFT starts."""
        record = ex.record
        record.ttft_from = t0
        pacer: Pacer
        if self.clock is not None:
            pacer = LockstepPacer(self.clock, t0, plan.ttft)
        else:
            pacer = FreePacer(t0, plan.ttft, plan.tokens_per_chunk / plan.tokens_per_second)
        job = Planned(
            ex,
            body,
            plan,
            pacer,
            created=int(time.time()),
            stamp=stamp_mode(
                self.config.stamp, self.config.stamp_in_text, record.headers.get("x-sim-stamp", "")
            ),
            system_fingerprint=self.config.system_fingerprint,
            keep=self.background.keep if kind == "responses" and _kept(body) else None,
        )
        return await _WRITERS[kind](job)

    async def _count_tokens(self, ex: Exchange, body: Any, t0: float) -> Outcome:
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            await ex.error(errors.bad_request("Field required: messages"))
            return "error"
        model = str(body.get("model") or self.config.models[0])
        if model not in self.config.models:
            await ex.error(errors.anthropic_error(errors.model_not_found(model)))
            return "error"
        ex.record.model = model
        ex.record.prompt_tokens = count_prompt_tokens(body)
        await ex.reply(200, messages_count_tokens(ex.record.prompt_tokens))
        return "completed"

    async def _embeddings(self, ex: Exchange, body: Any, t0: float) -> Outcome:
        return await self._pooled(ex, body, t0)

    async def _pooled(self, ex: Exchange, body: Any, t0: float) -> Outcome:
        """Embeddings and the pooling family: one body after the prefill latency."""
        record = ex.record
        if not isinstance(body, dict):
            await ex.error(errors.bad_request("The request body must be a JSON object."))
            return "error"
        try:
            tokens = pooling.prompt_tokens(record.path, body)
            ttft = number(record.headers, "x-sim-ttft", float, self.config.ttft, 0.0)
            per_token = number(
                record.headers,
                "x-sim-ttft-per-prompt-token",
                float,
                self.config.ttft_per_prompt_token,
                0.0,
            )
        except (pooling.PoolingInputError, ControlError) as exc:
            await ex.error(errors.bad_request(str(exc)))
            return "error"
        model = str(body.get("model") or self.config.models[0])
        record.model, record.prompt_tokens = model, tokens
        forced = record.headers.get("x-sim-error")
        if forced is not None:
            if forced not in errors.FORCED_ERRORS:
                await ex.error(errors.bad_request(f"x-sim-error: unknown value {forced!r}"))
            else:
                await ex.error(
                    errors.forced_error(
                        forced,
                        model=model,
                        max_model_len=self.config.max_model_len,
                        prompt_tokens=tokens,
                        max_tokens=None,
                    )
                )
            return "error"
        if model not in self.config.models:
            await ex.error(errors.model_not_found(model))
            return "error"
        if tokens > self.config.max_model_len:
            await ex.error(errors.context_length(self.config.max_model_len, tokens, None))
            return "error"
        delay = t0 + ttft + per_token * tokens - asyncio.get_running_loop().time()
        if delay > 0:
            await asyncio.sleep(delay)
        if record.path == "/v1/embeddings" and body.get("encoding_format") in BINARY:
            vectors, metadata = catalog.embeddings_bytes(record.id, model, body)
            record.first_token_at = time.monotonic()
            # a StreamingResponse in vLLM: chunked, no content-length
            extra = () if metadata is None else ((b"metadata", metadata),)
            await ex.start(200, b"application/octet-stream", extra)
            await ex.end(vectors, "completed")
            return "completed"
        if record.path == "/v1/embeddings":
            reply = catalog.embeddings(record.id, model, body)
        else:
            reply = pooling.reply(record.path, record.id, model, body)
        record.first_token_at = time.monotonic()
        await ex.reply(200, reply)
        return "completed"

    async def _tokenize(self, ex: Exchange, body: Any, t0: float) -> Outcome:
        if not isinstance(body, dict) or ("prompt" not in body and "messages" not in body):
            await ex.error(errors.bad_request("Field required: prompt or messages"))
            return "error"
        ex.record.prompt_tokens = count_prompt_tokens(body)
        await ex.reply(200, utility.tokenize(body, self.config.max_model_len))
        return "completed"

    async def _detokenize(self, ex: Exchange, body: Any, t0: float) -> Outcome:
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            await ex.error(errors.bad_request("Field required: tokens (a list of token ids)"))
            return "error"
        await ex.reply(200, utility.detokenize(tokens))
        return "completed"

    async def _ping(self, ex: Exchange, body: Any, t0: float) -> Outcome:
        await ex.reply(200, b"", b"")  # vLLM answers /ping as /health: no body, no type
        return "completed"

    async def _version(self, ex: Exchange, body: Any, t0: float) -> Outcome:
        if self.config.backend_kind == "llamacpp":  # llama-server has no /version
            await ex.error(errors.route_not_found())
            return "error"
        await ex.reply(200, utility.version())
        return "completed"

    async def _props(self, ex: Exchange, body: Any, t0: float) -> Outcome:
        # Only a simulator playing llama.cpp answers: its build_info names the backend.
        if self.config.backend_kind != "llamacpp":
            await ex.error(errors.route_not_found())
            return "error"
        await ex.reply(200, llamacpp.props(self.config.models[0], self.config.max_model_len))
        return "completed"

    async def _load(self, ex: Exchange, body: Any, t0: float) -> Outcome:
        # vLLM counts the requests in flight on its generation routes; not this one.
        await ex.reply(200, utility.load(self.state.active - 1))
        return "completed"

    async def _batch_chat(self, ex: Exchange, body: Any, t0: float) -> Outcome:
        """/v1/chat/completions/batch: played as one chat with a choice per conversation
        (proxy/sim/batch_chat.py)."""
        chat = batch_chat.as_chat(body)
        if chat is None:
            await ex.error(errors.bad_request("messages must be a non-empty list of conversations"))
            return "error"
        # vLLM builds no per-request metrics for a batch, even of one (batch_serving.py)
        return await self._generate("chat", ex, chat, t0, metrics=False)

    async def _label_reads(self, ex: Exchange, body: Any, t0: float) -> Outcome:
        """/generative_scoring and /v1/systemone: one-token reads, one body after the
        prefill latency (proxy/sim/label_reads.py)."""
        record = ex.record
        scoring = record.path == "/generative_scoring"
        try:
            if not isinstance(body, dict):
                raise pooling.PoolingInputError("The request body must be a JSON object.")
            reads = (label_reads.scoring_reads if scoring else label_reads.decision_reads)(body)
        except pooling.PoolingInputError as exc:
            await ex.error(errors.bad_request(str(exc)))
            return "error"
        model = str(body.get("model") or self.config.models[0])
        record.model, record.prompt_tokens = model, label_reads.prompt_tokens(reads)
        if model not in self.config.models:
            await ex.error(errors.model_not_found(model))
            return "error"
        ttft = number(record.headers, "x-sim-ttft", float, self.config.ttft, 0.0)
        delay = t0 + ttft - asyncio.get_running_loop().time()
        if delay > 0:
            await asyncio.sleep(delay)
        reply = label_reads.scoring_reply if scoring else label_reads.decision_reply
        record.first_token_at = time.monotonic()
        await ex.reply(200, reply(record.id, model, reads))
        return "completed"

    async def _responses(self, ex: Exchange, body: Any, t0: float) -> Outcome:
        """/v1/responses; a background response generates in a task of its own
        (proxy/sim/background.py): streamed, the POST reads its stored events, so a client
        that leaves stops only its reading; not streamed, the POST answers the response
        `queued` at once (vLLM's serving.py:537-589). A `previous_response_id` the store
        does not hold is a 404 once the request is valid (serving.py:361-367); one that is
        not a string is refused with the body (responses.invalid_previous_id)."""
        refused = invalid_previous_id(body)
        if refused is not None:
            await ex.error(refused)
            return "error"
        plan = plan_request("responses", body, ex.record.headers, self.config)
        if isinstance(plan, errors.ErrorReply):  # refused before anything is stored
            await ex.error(plan)
            return "error"
        previous = body.get("previous_response_id")  # a plan means a JSON object
        if isinstance(previous, str) and self.background.get(previous) is None:
            await ex.error(background.not_found(previous))
            return "error"
        if lax_bool(body.get("background")) is not True:
            return await self._generate("responses", ex, body, t0, planned=plan)
        queued = ResponsesWire(plan, body, ex.record.id, int(time.time()))
        streamed = lax_bool(body.get("stream")) is True
        stored = self.background.open(ex.record.id, queued.response("queued", [], None), streamed)
        writer = background.StoreExchange(ex.record, self.state, stored)
        stored.task = asyncio.create_task(
            background.generate(stored, self._generate("responses", writer, body, t0))
        )
        if streamed:
            return await background.relay(ex, stored, None)
        ex.record.model, ex.record.stream = plan.model, False
        await ex.reply(200, orjson.dumps(stored.response))
        return "completed"

    async def _retrieve_response(self, ex: Exchange, body: Any, t0: float) -> Outcome:
        """GET /v1/responses/{id}: a background stream's stored events from
        `starting_after + 1` with `stream`, else the stored response object (`queued`
        until its generation ended, serving.py:1133-1154)."""
        response_id = ex.record.path.rpartition("/")[2]
        query = body if isinstance(body, dict) else {}
        try:
            stream = background.query_bool(query.get("stream"))
            after = query.get("starting_after")
            starting_after = None if after is None else int(after)
        except ValueError:
            await ex.error(errors.bad_request("stream must be a bool, starting_after an int"))
            return "error"
        stored = self.background.get(response_id)
        if stored is None:
            await ex.error(background.not_found(response_id))
            return "error"
        ex.record.stream = bool(stream)
        if stream:
            return await background.relay(ex, stored, starting_after)
        await ex.reply(200, orjson.dumps(stored.response))
        return "completed"

    async def _invocations(self, ex: Exchange, body: Any, t0: float) -> Outcome:
        target = utility.invocation_route(body)
        if target is None:
            # vLLM's answer when no request type takes the body (api_router.py), in the
            # words of a generative model's server
            await ex.error(
                errors.bad_request(
                    "Cannot find suitable handler for request. Expected one of: "
                    "['ChatCompletionRequest', 'CompletionRequest']"
                )
            )
            return "error"
        _, handler = _ROUTES[target]
        return await handler(self, ex, body, t0)

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
                await self.background.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _deny_upgrade(scope: Scope, send: Send, reply: errors.ErrorReply) -> None:
    """Refuse a WebSocket upgrade with an HTTP answer (the ASGI WebSocket Denial Response);
    a server without that extension can only refuse it bare (uvicorn answers 403)."""
    if "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": 1008})
        return
    headers = [(b"content-length", b"%d" % len(reply.body)), (b"content-type", reply.content_type)]
    await send(
        {"type": "websocket.http.response.start", "status": reply.status, "headers": headers}
    )
    await send({"type": "websocket.http.response.body", "body": reply.body})


@dataclass(frozen=True, slots=True)
class Planned:
    """One planned generation, ready to be written in its API's wire format."""

    ex: Exchange
    body: Any
    plan: Plan
    pacer: Pacer
    created: int
    stamp: str  # proxy/sim/wire.py STAMPS
    system_fingerprint: str | None
    #: Where a Responses response is stored once it ends (proxy/sim/background.py), None
    #: when vLLM would not store it there.
    keep: Callable[[dict[str, Any]], None] | None = None


async def _events(job: Planned, events: MessagesWire | ResponsesWire | CohereWire) -> Outcome:
    if not job.plan.stream:
        return await complete_events(job.ex, job.plan, events, job.pacer)
    return await stream_events(job.ex, job.plan, events, job.pacer)


async def _write_messages(job: Planned) -> Outcome:
    events = MessagesWire(job.plan, job.ex.record.id, job.stamp)
    if job.plan.script is not None and job.plan.stream:
        return await stream_script(job.ex, job.plan, job.pacer, MessagesScript(job.plan, events))
    return await _events(job, events)


async def _write_cohere(job: Planned) -> Outcome:
    events = CohereWire(job.plan, job.ex.record.id)
    if job.plan.script is not None and job.plan.stream:
        return await stream_script(job.ex, job.plan, job.pacer, CohereScript(job.plan, events))
    return await _events(job, events)


async def _write_responses(job: Planned) -> Outcome:
    ex, plan = job.ex, job.plan
    events = ResponsesWire(plan, job.body, ex.record.id, job.created, job.stamp)
    events.on_final = job.keep
    if plan.metrics:
        events.metrics = lambda sent, streamed: engine_metrics(ex, plan, sent, streamed)
    if plan.script is not None and plan.stream:
        return await stream_script(ex, plan, job.pacer, ResponsesScript(plan, events))
    return await _events(job, events)


async def _write_generate(job: Planned) -> Outcome:
    ex, plan = job.ex, job.plan
    gen = GenerateWire(plan, ex.record.id)
    if not plan.stream:
        return await complete_generate(ex, plan, gen, job.pacer, job.created)
    return await stream_generate(ex, plan, gen, job.pacer)


def _write_audio(translation: bool) -> Callable[[Planned], Awaitable[Outcome]]:
    async def write(job: Planned) -> Outcome:
        ex, plan = job.ex, job.plan
        if not plan.stream:
            await paced_whole(ex, plan, job.pacer, plan.finish_reason)
            text = completion_text(plan.output_tokens)
            await ex.reply(200, audio.full(translation, text, job.body["audio_seconds"]))
            return "completed"
        chunks = audio.AudioWire(translation, ex.record.id, job.created, plan.model)
        return await stream(ex, plan, chunks, job.pacer)

    return write


def _write_openai(chat: bool) -> Callable[[Planned], Awaitable[Outcome]]:
    async def write(job: Planned) -> Outcome:
        ex, plan = job.ex, job.plan
        if plan.backend == "llamacpp":
            if not plan.stream:
                return await llamacpp.complete_llamacpp(ex, plan, chat, job.created, job.pacer)
            return await llamacpp.stream_llamacpp(ex, plan, chat, job.created, job.pacer)
        if not plan.stream:
            return await complete(
                ex, plan, job.pacer, ex.record.id, job.created, job.system_fingerprint
            )
        sse = StreamWire(
            chat, ex.record.id, job.created, plan.model, job.stamp, job.system_fingerprint
        )
        if chat and plan.script is not None:
            head = StreamWire(chat, ex.record.id, job.created, plan.model, "").role()
            head = head[: head.index(b',"choices"')]
            return await stream_script(ex, plan, job.pacer, ChatScript(plan, sse, head))
        return await stream(ex, plan, sse, job.pacer)

    return write


def _write_ollama(chat: bool) -> Callable[[Planned], Awaitable[Outcome]]:
    async def write(job: Planned) -> Outcome:
        ex, plan, record = job.ex, job.plan, job.ex.record
        timer = ollama.Timer(int(record.started * 1e9))
        if record.loaded_at is not None:
            timer.loaded = int(record.loaded_at * 1e9)
        body = job.body if isinstance(job.body, dict) else {}
        if not body.get("messages" if chat else "prompt"):  # load (or unload) only
            reason = "unload" if ollama.unload_only(body, chat) else "load"
            await ex.reply(200, ollama.load_reply(plan.model, reason, chat), errors.OLLAMA_JSON)
            return "completed"
        thinking = ollama.thinking_tokens(body, record.headers)
        wire = ollama.OllamaWire(plan, chat, thinking, timer, raw=body.get("raw") is True)
        if not plan.stream:
            return await ollama.complete_ollama(ex, plan, wire, job.pacer)
        return await ollama.stream_ollama(ex, plan, wire, job.pacer)

    return write


async def _write_llamacpp_native(job: Planned) -> Outcome:
    if not job.plan.stream:
        return await llamacpp_native.complete_native(job.ex, job.plan, job.body, job.pacer)
    return await llamacpp_native.stream_native(job.ex, job.plan, job.body, job.pacer)


#: Each generation kind's wire writer: a new generation API adds its line here.
_WRITERS: dict[Kind, Callable[[Planned], Awaitable[Outcome]]] = {
    "chat": _write_openai(chat=True),
    "completion": _write_openai(chat=False),
    "messages": _write_messages,
    "responses": _write_responses,
    "generate": _write_generate,
    "cohere": _write_cohere,
    "transcription": _write_audio(translation=False),
    "translation": _write_audio(translation=True),
    "ollama-chat": _write_ollama(chat=True),
    "ollama-generate": _write_ollama(chat=False),
    "llamacpp-completion": _write_llamacpp_native,
}


def _generation(kind: Kind) -> Handler:
    """The route handler of a generation API: plan the request, then write it as `kind`."""

    async def handle(app: SimApp, ex: Exchange, body: Any, t0: float) -> Outcome:
        return await app._generate(kind, ex, body, t0)

    return handle


_GET, _POST = frozenset({"GET"}), frozenset({"POST"})

_ROUTES: dict[str, tuple[frozenset[str], Handler]] = {
    "/v1/models": (_GET, SimApp._models_list),
    "/v1/chat/completions": (_POST, _generation("chat")),
    "/v1/chat/completions/batch": (_POST, SimApp._batch_chat),
    "/v1/completions": (_POST, _generation("completion")),
    "/v1/messages": (_POST, _generation("messages")),
    "/v1/messages/count_tokens": (_POST, SimApp._count_tokens),
    "/v1/responses": (_POST, SimApp._responses),
    "/v1/embeddings": (_POST, SimApp._embeddings),
    "/inference/v1/generate": (_POST, _generation("generate")),
    "/v1/audio/transcriptions": (_POST, _generation("transcription")),
    "/v1/audio/translations": (_POST, _generation("translation")),
    "/cohere/v2/chat": (_POST, _generation("cohere")),
    **{
        path: (_POST, SimApp._pooled)
        for path in (
            "/pooling",
            "/score",
            "/v1/score",
            "/rerank",
            "/v1/rerank",
            "/v2/rerank",
            "/classify",
            "/v1/classify",
        )
    },
    "/tokenize": (_POST, SimApp._tokenize),
    "/detokenize": (_POST, SimApp._detokenize),
    "/ping": (frozenset({"GET", "POST"}), SimApp._ping),
    "/version": (_GET, SimApp._version),
    "/props": (_GET, SimApp._props),
    "/load": (_GET, SimApp._load),
    "/invocations": (_POST, SimApp._invocations),
    "/generative_scoring": (_POST, SimApp._label_reads),
    "/v1/systemone": (_POST, SimApp._label_reads),
    "/api/chat": (_POST, _generation("ollama-chat")),
    "/api/generate": (_POST, _generation("ollama-generate")),
    "/api/embed": (_POST, SimApp._ollama_embed),
    "/api/version": (frozenset({"GET", "HEAD"}), SimApp._ollama_version),
    "/completion": (_POST, SimApp._llamacpp_completion),
    "/completions": (_POST, SimApp._llamacpp_completion),
}


#: `/` of a simulator playing Ollama (SimConfig.ollama_version).
_OLLAMA_ROOT: tuple[frozenset[str], Handler] = (frozenset({"GET", "HEAD"}), SimApp._ollama_root)


def _item_route(path: str) -> tuple[frozenset[str], Handler] | None:
    """The route of one stored Response, `/v1/responses/{response_id}` (vLLM's
    responses/api_router.py retrieve_responses), or None."""
    parent, _, item = path.rpartition("/")
    if parent == "/v1/responses" and item:
        return _GET, SimApp._retrieve_response
    return None


# vLLM's id prefixes; its Anthropic layer reuses the chat completion's id.
_ID_PREFIX = {
    "/v1/chat/completions": "chatcmpl-",
    "/v1/chat/completions/batch": "chatcmpl-",
    "/v1/completions": "cmpl-",
    "/v1/messages": "chatcmpl-",
    "/v1/responses": "resp_",
    "/v1/embeddings": "embd-",
    "/inference/v1/generate": "generate-tokens-",
    "/v1/audio/transcriptions": "trsc-",
    "/v1/audio/translations": "trsl-",
    "/cohere/v2/chat": "chatcmpl-",
    "/pooling": "pool-",
    "/score": "score-",
    "/v1/score": "score-",
    "/rerank": "rerank-",
    "/v1/rerank": "rerank-",
    "/v2/rerank": "rerank-",
    "/classify": "classify-",
    "/v1/classify": "classify-",
}


#: The prefixes vLLM 0.32 guards with --api-key, and only those: /pooling, /score,
#: /rerank, /classify, /tokenize, /invocations... answer without the key
#: (vllm/entrypoints/serve/middleware/authenticate.py GUARDED_PREFIX, checked before any
#: route; OPTIONS is never guarded).
_ALWAYS_GUARDED = ("/v1", "/v2", "/inference", "/cohere")


def _guarded(path: str) -> bool:
    return path.startswith(_ALWAYS_GUARDED)


class ApiKeys:
    """vLLM 0.32's check of a request's key, as vllm/entrypoints/serve/middleware/
    authenticate.py `AuthenticationMiddleware.verify_token` makes it: the first
    Authorization header, split at its first space; the scheme "bearer" in any case; what
    follows, spaces included, one of the keys exactly. So `Bearer  key` (two spaces), a tab
    after the scheme, or the key without its scheme are refused. vLLM compares SHA-256
    digests of the header's text and of each key (encoded as UTF-8), which are equal just
    when the two strings are."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self._keys = frozenset(keys)

    def admit(self, headers: list[tuple[bytes, bytes]]) -> bool:
        # starlette's Headers.get: the first header of that name; values read as latin-1
        value = next((v for k, v in headers if k.lower() == b"authorization"), b"")
        scheme, _, key = value.decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and key in self._keys


_FORMS = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})
#: The encodings vLLM answers with raw bytes, not JSON (vllm/utils/serial_utils.py).
BINARY = frozenset({"bytes", "bytes_only"})


def _parse_form(raw: bytes, content_type: str) -> tuple[Any, str | None]:
    """(the audio form read as a request or None, why it cannot be read or None)."""
    try:
        return audio.form_body(raw, content_type), None
    except audio.AudioInputError as exc:
        return None, str(exc)


def _kept(body: Any) -> bool:
    """Whether a Responses request's response is stored when it ends, apart from the
    background ones (stored from the start, proxy/sim/background.py)."""
    return (
        isinstance(body, dict)
        and lax_bool(body.get("background")) is not True
        and background.stores(body)
    )


def _response_id(path: str, headers: dict[str, str]) -> str:
    # vLLM builds the id from the client's X-Request-Id when there is one.
    base = headers.get("x-request-id") or uuid.uuid4().hex
    return _ID_PREFIX.get(path, "req-") + base
