"""Helpers shared by the simulator's tests (this module holds no tests).

`read_events` records when each SSE event's last byte arrived, so tests can bound
timing as a client sees it, and keeps the raw bytes, so they can assert on the wire.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from proxy.sim import SimApp, SimConfig, create_sim_app
from tests.servers import ThreadedServer, default_trust, serve


@dataclass
class Event:
    at: float  # seconds from just before the request was sent to the event's arrival
    data: bytes  # after "data: ", before the blank line

    @property
    def json(self) -> Any:
        return json.loads(self.data)

    @property
    def is_content(self) -> bool:
        if self.data == b"[DONE]":
            return False
        choices = self.json.get("choices") or [{}]
        choice = choices[0]
        return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


@dataclass
class Streamed:
    status: int
    headers: httpx.Headers
    events: list[Event]
    headers_at: float
    raw: bytes

    def contents(self) -> list[Event]:
        return [e for e in self.events if e.is_content]

    def text(self) -> str:
        out = []
        for e in self.contents():
            choice = e.json["choices"][0]
            out.append(choice.get("text") or choice["delta"]["content"])
        return "".join(out)


def chat(stream: bool = True, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "Say something."}],
        "stream": stream,
    }
    body.update(extra)
    return body


def read_events(
    client: httpx.Client,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    path: str = "/v1/chat/completions",
) -> Streamed:
    """POST and read the whole SSE response, timing every event's arrival."""
    t0 = time.monotonic()
    with client.stream("POST", url + path, json=body, headers=headers or {}) as response:
        headers_at = time.monotonic() - t0
        events: list[Event] = []
        buffer = b""
        raw = []
        for piece in response.iter_raw():
            now = time.monotonic() - t0
            raw.append(piece)
            buffer += piece
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                assert event.startswith(b"data: "), event[:80]
                events.append(Event(now, event[len(b"data: ") :]))
        assert buffer == b"", buffer[:80]
        return Streamed(response.status_code, response.headers, events, headers_at, b"".join(raw))


@contextmanager
def running(config: SimConfig) -> Iterator[tuple[ThreadedServer, SimApp]]:
    app = create_sim_app(config)
    with serve(app) as server:
        yield server, app


@contextmanager
def warm_client(url: str, **kw: Any) -> Iterator[httpx.Client]:
    """A keep-alive client with its connection already open, so timings exclude connecting.
    Its TLS trust made once (`default_trust`): httpx makes one for every client, 20 ms of
    CPU, and the simulator's tests open 180 of these a run."""
    with httpx.Client(timeout=10, **{"verify": default_trust(), **kw}) as client:
        client.get(url + "/health").raise_for_status()
        yield client


def best_of(attempts: int, check: Callable[[], None]) -> None:
    """Run a timing check up to `attempts` times; pass on the first clean run.

    A shared CI box can deschedule the server for tens of milliseconds at any moment.
    One clean run shows the simulator keeps time; a real pacing bug (early tokens,
    drift) fails every run.
    """
    for attempt in range(attempts):
        try:
            check()
            return
        except AssertionError:
            if attempt == attempts - 1:
                raise


@dataclass
class NamedEvent:
    """One `event: <name>\\ndata: <json>` block of a Messages or Responses stream."""

    at: float  # seconds from just before the request was sent to the event's arrival
    name: str
    data: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.data)


@dataclass
class NamedStream:
    status: int
    events: list[NamedEvent]
    raw: bytes

    def names(self) -> list[str]:
        return [e.name for e in self.events]

    def first(self, name: str) -> NamedEvent:
        return next(e for e in self.events if e.name == name)


def read_named_events(
    client: httpx.Client,
    url: str,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> NamedStream:
    """POST and read a whole stream of named SSE events, timing every event's arrival."""
    t0 = time.monotonic()
    with client.stream("POST", url + path, json=body, headers=headers or {}) as response:
        events: list[NamedEvent] = []
        buffer = b""
        raw = []
        for piece in response.iter_raw():
            now = time.monotonic() - t0
            raw.append(piece)
            buffer += piece
            while b"\n\n" in buffer:
                block, buffer = buffer.split(b"\n\n", 1)
                head, _, data = block.partition(b"\n")
                assert head.startswith(b"event: ") and data.startswith(b"data: "), block[:80]
                events.append(NamedEvent(now, head[7:].decode(), data[6:]))
        assert buffer == b"", buffer[:80]
        return NamedStream(response.status_code, events, b"".join(raw))
