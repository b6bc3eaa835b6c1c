"""Background Responses, as vLLM 0.32 runs them (`background: true` with `stream: true`),
and their retrieval, `GET /v1/responses/{id}` (`?stream=true&starting_after=N`).

Facts (vllm/entrypoints/openai/responses/):
- serving.py:537-589: a background request's generation runs in a task of its own,
  `_run_background_request_stream` (serving.py:1070-1085), which appends every event of
  the stream to the response's deque in `event_store`; the POST's answer is
  `responses_background_stream_generator` reading that deque. A client that leaves stops
  only its reader (api_router.py `with_cancellation` cancels the handler, not the task):
  the generation goes on to its end.
- serving.py:1104-1131: a reader starts at `starting_after + 1` (0 without it), yields
  each event and returns after `response.completed`; an id with no events (a response
  not streamed) raises inside the stream, after the 200: an empty body.
- serving.py:1133-1154, api_router.py:82-109: `GET /v1/responses/{response_id}` takes
  `stream` and `starting_after` as query parameters; a stored response not streamed is
  its JSON; an unknown id is a 404 (`_make_not_found_error`, serving.py:1185-1191).
The simulator keeps one `Stored` per background stream; its events are the bytes its
generation writes, one event per write (proxy/sim/events.py), so an event's index in the
deque is its `sequence_number`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any

import orjson
from starlette.types import Message

from proxy.sim.errors import ErrorReply, error_json
from proxy.sim.exchange import Exchange
from proxy.sim.state import Outcome, SimRequest, SimState

SSE = b"text/event-stream"
_COMPLETED = b"event: response.completed\n"
#: pydantic's words for a query's bool (FastAPI reads `stream: bool | None` with them).
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


class Stored:
    """One background response: its events as its generation wrote them (vLLM's deque and
    its signal), and the head it started with (an error answered before any event)."""

    def __init__(self) -> None:
        self.events: list[bytes] = []
        self.signal = asyncio.Event()
        self.head: tuple[int, bytes] | None = None  # status, content type
        self.body = b""  # a non-SSE answer's body (the generation's own error)
        self.done = False
        self.task: asyncio.Task[Outcome] | None = None  # kept: a task must be referenced


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


class BackgroundStore:
    """vLLM's `event_store`, by response id."""

    def __init__(self) -> None:
        self._stored: dict[str, Stored] = {}

    def open(self, response_id: str) -> Stored:
        stored = self._stored[response_id] = Stored()
        return stored

    def get(self, response_id: str) -> Stored | None:
        return self._stored.get(response_id)


async def generate(stored: Stored, generation: Coroutine[Any, Any, Outcome]) -> Outcome:
    """Run a background response's generation; whatever ends it, its readers are told."""
    try:
        return await generation
    finally:
        if stored.head is None:  # it failed before a head: vLLM's 500
            message = error_json("background generation failed", "InternalServerError", 500)
            stored.head, stored.body = (500, b"application/json"), message
        stored.done = True
        stored.signal.set()


async def relay(ex: Exchange, stored: Stored, starting_after: int | None) -> Outcome:
    """A reader of the stored events (responses_background_stream_generator): from
    `starting_after + 1` up to `response.completed`, as they come. The generation's own
    answer when it answered no stream (an error before its first event)."""
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


def latest_response(stored: Stored) -> dict[str, Any] | None:
    """The response object of the last event that carries one (created, in_progress,
    completed): what a retrieval without `stream` answers here."""
    for event in reversed(stored.events):
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
