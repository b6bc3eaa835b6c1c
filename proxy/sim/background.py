"""Background Responses, as vLLM 0.32 runs them (`background: true`, streamed or not),
and their retrieval, `GET /v1/responses/{id}` (`?stream=true&starting_after=N`).

Facts (vllm/entrypoints/openai/responses/):
- serving.py:537-589: a background request's generation runs in a task of its own, and
  the response is stored at once `queued`, with no output and no usage. Not streamed,
  the POST answers that object at once (serving.py:589) and `_run_background_request`
  (serving.py:1087-1102) runs `responses_full_generator`, which stores the final
  response, status and usage (serving.py:928-932); an error stores the queued object's
  status as `failed`, no usage. Streamed, `_run_background_request_stream`
  (serving.py:1070-1085) appends every event to the response's deque in `event_store`
  and the POST's answer is `responses_background_stream_generator` reading that deque;
  the stream's end stores the final response the same way (serving.py:1408 calls
  `responses_full_generator`). A client that leaves stops only its reader (api_router.py
  `with_cancellation` cancels the handler, not the task): the generation goes on.
- serving.py:1104-1131: a reader starts at `starting_after + 1` (0 without it), yields
  each event and returns after `response.completed`; an id with no events (a response
  not streamed) raises inside the stream, after the 200 went out (Starlette's
  StreamingResponse sends its head first): the connection is dropped, no body.
- serving.py:1133-1154, api_router.py:80-107: `GET /v1/responses/{response_id}` takes
  `stream` and `starting_after` as query parameters; without `stream` it answers the
  stored object (`queued` until the generation stored the final one); an unknown id is a
  404 (`_make_not_found_error`, serving.py:1185-1191).
- serving.py:361-367: a request's `previous_response_id` is looked up in that store,
  after the request was validated and before anything is generated; one it does not hold
  is the same 404. responses_full_generator stores every response whose request has
  `store` true (the default, protocol.py `store: bool | None = True`), background or
  not, before its body or its `response.completed` goes out (serving.py:927-932, 1408);
  one that failed or whose client left is not stored. (vLLM stores nothing unless it
  runs with VLLM_ENABLE_RESPONSES_API_STORE=1, serving.py:160-171, and refuses
  `background` without it: the simulator plays a vLLM started with it.)
The simulator keeps one `Stored` per background response; a stream's events are the bytes
its generation writes, one event per write (proxy/sim/events.py), so an event's index in
the deque is its `sequence_number`. A response not in the background is kept whole, with
no events (vLLM's event_store has none for it), once it ended; the oldest ended ones are
forgotten past `KEPT` (vLLM forgets none: its FIXME, serving.py:180-183).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any

import orjson
from starlette.types import Message

from proxy.core.lax import lax_bool
from proxy.sim.errors import ErrorReply, error_json
from proxy.sim.exchange import Exchange
from proxy.sim.state import Outcome, SimRequest, SimState

SSE = b"text/event-stream"
_COMPLETED = b"event: response.completed\n"
_INCOMPLETE = b"event: response.incomplete\n"
#: pydantic's words for a query's bool (FastAPI reads `stream: bool | None` with them).
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


class Stored:
    """One background response: the stored object (vLLM's `response_store`), a stream's
    events as its generation wrote them (its deque and signal in `event_store`), and the
    head the generation started with (an error answered before any event)."""

    def __init__(self, queued: dict[str, Any], streamed: bool) -> None:
        self.response = queued  # what a retrieval without `stream` answers
        self.streamed = streamed  # it has an event deque (vLLM's event_store)
        self.events: list[bytes] = []
        self.signal = asyncio.Event()
        self.head: tuple[int, bytes] | None = None  # status, content type
        self.body = b""  # a body not streamed (the answer, or the generation's own error)
        self.done = False
        self.task: asyncio.Task[Outcome] | None = None  # kept: a task must be referenced

    def store_final(self) -> None:
        """The generation ended: the final response stored in place of the queued one
        (serving.py:928-932), from the stream's `response.completed`/`.incomplete` or the
        body; a generation that failed without one leaves it `failed` when not streamed
        (serving.py:1093-1102), `queued` when streamed (nothing stores another)."""
        if self.streamed:
            final = final_response(self.events)
            if final is not None:
                self.response = final
            return
        if self.head is not None and self.head[0] == 200:
            try:
                self.response = orjson.loads(self.body)
                return
            except orjson.JSONDecodeError:
                pass
        self.response = {**self.response, "status": "failed"}


class StoreExchange(Exchange):
    """What the generation writes to in place of a client: the stored response's events
    (serving.py `_run_background_request_stream`). No client, so nothing cancels it."""

    __slots__ = ("stored",)

    def __init__(self, record: SimRequest, state: SimState, stored: Stored) -> None:
        super().__init__(_no_receive, _no_send, record, state, hash_body=False)
        self.stored = stored

    async def start(
        self, status: int, content_type: bytes, extra: Sequence[tuple[bytes, bytes]] = ()
    ) -> None:
        self.stored.head = (status, content_type)
        self.record.status = status
        self.stored.signal.set()

    async def write(self, data: bytes) -> None:
        self._keep(data)

    async def end(self, data: bytes = b"", outcome: Outcome = "completed") -> None:
        self.complete = True
        self._keep(data)
        self.stored.done = True
        self.stored.signal.set()

    def finish(self, outcome: Outcome) -> None:
        """The POST's own exchange ends the record; the generation may outlive it."""

    def _keep(self, data: bytes) -> None:
        stored = self.stored
        if stored.head is not None and not stored.head[1].startswith(SSE):
            stored.body += data
        elif data:
            stored.events.extend(event + b"\n\n" for event in data.split(b"\n\n") if event)
        stored.signal.set()


async def _no_receive() -> Message:
    await asyncio.Event().wait()  # never: a background generation has no client
    return {"type": "http.disconnect"}


async def _no_send(message: Message) -> None:
    return None


#: How many responses the store holds before it forgets the oldest ended ones: a simulator
#: that serves a long benchmark must not grow without end, as vLLM's store does.
KEPT = 4096


def stores(body: dict[str, Any]) -> bool:
    """Whether vLLM stores the response to `body` when it ends: `store` left out or true
    (null is falsy there, serving.py:927)."""
    return "store" not in body or lax_bool(body["store"]) is True


class BackgroundStore:
    """vLLM's `response_store` and `event_store`, by response id."""

    def __init__(self) -> None:
        self._stored: dict[str, Stored] = {}

    def open(self, response_id: str, queued: dict[str, Any], streamed: bool) -> Stored:
        stored = self._stored[response_id] = Stored(queued, streamed)
        self._forget()
        return stored

    def keep(self, response: dict[str, Any]) -> None:
        """A response not in the background, ended: stored whole, not streamed (no
        events), so a retrieval answers it and a later request may continue it."""
        stored = Stored(response, streamed=False)
        stored.done = True
        self._stored[response["id"]] = stored
        self._forget()

    def _forget(self) -> None:
        """Past KEPT, the oldest ended responses go; a generation still running stays
        (its task is referenced from its `Stored`)."""
        while len(self._stored) > KEPT:
            oldest = next((rid for rid, s in self._stored.items() if s.done), None)
            if oldest is None:
                return
            del self._stored[oldest]

    def get(self, response_id: str) -> Stored | None:
        return self._stored.get(response_id)

    async def stop(self) -> None:
        """The server stops: the generations still running end with it (as vLLM's tasks
        die with its loop), not left pending on a closed loop."""
        tasks = [s.task for s in self._stored.values() if s.task is not None and not s.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def generate(stored: Stored, generation: Coroutine[Any, Any, Outcome]) -> Outcome:
    """Run a background response's generation; whatever ends it, its readers are told."""
    try:
        return await generation
    finally:
        if stored.head is None:  # it failed before a head: vLLM's 500
            message = error_json("background generation failed", "InternalServerError", 500)
            stored.head, stored.body = (500, b"application/json"), message
        stored.store_final()
        stored.done = True
        stored.signal.set()


async def relay(ex: Exchange, stored: Stored, starting_after: int | None) -> Outcome:
    """A reader of the stored events (responses_background_stream_generator): from
    `starting_after + 1` up to `response.completed`, as they come. The generation's own
    answer when it answered no stream (an error before its first event). A response not
    streamed has no events: vLLM's reader raises once its 200 went out, and the server
    drops the connection (the simulator returns with the body unfinished)."""
    if not stored.streamed:
        await ex.start(200, SSE + b"; charset=utf-8")
        return "error"
    while stored.head is None:
        stored.signal.clear()
        await stored.signal.wait()
    status, content_type = stored.head
    if not content_type.startswith(SSE):
        while not stored.done:
            stored.signal.clear()
            await stored.signal.wait()
        await ex.reply(status, stored.body, content_type, (), "error")
        return "error"
    await ex.start(200, content_type)
    index = 0 if starting_after is None else starting_after + 1
    while True:
        stored.signal.clear()
        while index < len(stored.events):
            event = stored.events[index]
            index += 1
            if event.startswith(_COMPLETED):
                await ex.end(event)
                return "completed"
            await ex.write(event)
        if stored.done:  # ended without response.completed: vLLM's reader would wait on
            await ex.end()
            return "completed"
        await stored.signal.wait()


def final_response(events: list[bytes]) -> dict[str, Any] | None:
    """The response object of a stream's `response.completed` or `response.incomplete`
    (what responses_full_generator built and stored), None when it has neither."""
    for event in reversed(events):
        if not event.startswith((_COMPLETED, _INCOMPLETE)):
            continue
        _, _, data = event.partition(b"data: ")
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            continue
        response = obj.get("response") if isinstance(obj, dict) else None
        if isinstance(response, dict):
            return response
    return None


def query_bool(value: str | None) -> bool | None:
    """A query parameter read as FastAPI reads a bool; None when absent, ValueError when
    it is no bool (vLLM's 422)."""
    if value is None:
        return None
    word = value.lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise ValueError(value)


def not_found(response_id: str) -> ErrorReply:
    message = f"Response with id '{response_id}' not found."
    return ErrorReply(404, error_json(message, "invalid_request_error", 404, "response_id"))
