"""What the simulated backend saw and did, one record per /v1 request.

Tests read this to prove what reached the backend (headers, body) and how each
exchange ended: above all `outcome == "aborted"`, which shows that a proxy in front
cancelled its upstream request when its own client went away.

Records are written on the server's event loop and read from test threads: list
changes and lifecycle steps go through one lock; per-chunk counters are plain
attribute updates, cheap on the hot path and safe to read at any time.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from proxy.core.secrets import SECRET_PARAMS, is_secret_header, is_secret_name

Outcome = Literal["completed", "aborted", "error", "fault", "in_progress"]


@dataclass(slots=True)
class SimRequest:
    """One request as the simulator saw it. Instants are `time.monotonic()` seconds."""

    id: str  # the response id the client sees ("chatcmpl-...", "cmpl-...", "req-...")
    path: str
    method: str
    headers: dict[str, str]  # lower-case names; the last value wins for repeated names
    body: Any  # parsed JSON, or None (no body, or not JSON)
    started: float  # the ASGI call began (request line and headers received)
    status: int = 0  # HTTP status sent (0 until the response starts)
    model: str | None = None
    stream: bool = False
    first_byte_at: float | None = None  # response status and headers sent
    first_token_at: float | None = None  # first chunk with generated text sent
    queued_at: float | None = None  # routed to generation: the engine has it, queueing starts
    scheduled_at: float | None = None  # a slot was free (max_num_seqs): its queue time ends
    loaded_at: float | None = None  # Ollama: the model was loaded (after its load time)
    # The loop time the programmed TTFT runs from: the call's start, a free slot, or the
    # model loaded. uvloop's loop time is the loop's cached clock, ms behind `started` on
    # a loaded machine, so the first token's instant is bounded by this, not by `started`.
    ttft_from: float | None = None
    finished_at: float | None = None
    outcome: Outcome = "in_progress"
    aborted_at: float | None = None  # the client's disconnect was seen
    fault: str | None = None  # the x-sim-fault that fired, if any
    finish_reason: str | None = None  # as sent: chat's finish_reason, Messages' stop_reason,
    # Responses' "completed" or its incomplete_details.reason
    prompt_tokens: int = 0
    # Generated tokens actually sent, as vLLM's usage counts them: each choice's EOS token
    # too (no text, but its finish chunk or closing events went out: controls.Plan.eos).
    completion_tokens: int = 0
    chunks_sent: int = 0  # response-body writes (one per SSE event when streaming)
    bytes_sent: int = 0  # response-body bytes
    body_sha256: str | None = None  # of all body bytes sent; only with record_bodies

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready copy with credentials masked (`MASK`): the value of every header
        that carries one (`is_secret_header`: authorization, x-api-key, api-key, cookie,
        x-goog-api-key, ...; not the simulator's own x-sim-* controls, whose names hold
        `token` for counts), and of every body field named like one (`is_secret_name`:
        api_key, password, a credentials object, at any depth) that holds text: counts
        and token ids stay (`max_tokens`, `prompt_token_ids`). A GET's body is its query,
        whose `?key=`, `?sig=` and `?code=` carry one too (`SECRET_PARAMS`)."""
        out = asdict(self)
        out["headers"] = {
            name: MASK if _secret_header(name) else value for name, value in self.headers.items()
        }
        out["body"] = _masked(out["body"], query=self.method == "GET")
        return out


#: What a credential's value shows as in /sim/requests.
MASK = "***"
#: The simulator's own request controls (controls.py), never a credential.
_CONTROLS = "x-sim-"


def _secret_header(name: str) -> bool:
    return is_secret_header(name) and not name.startswith(_CONTROLS)


def _masked(value: Any, query: bool = False) -> Any:
    """`value` with each field named like a credential masked where it holds text;
    `query`: the top level is a query's parameters, named by the query's rules."""
    if isinstance(value, dict):
        return {
            name: MASK if _secret_field(name, query) and _holds_text(inner) else _masked(inner)
            for name, inner in value.items()
        }
    if isinstance(value, list):
        return [_masked(item) for item in value]
    return value


def _secret_field(name: object, query: bool) -> bool:
    lowered = str(name).lower()
    return is_secret_name(lowered) or (query and lowered in SECRET_PARAMS)


def _holds_text(value: Any) -> bool:
    """A string, or an object or list with one inside (an object's names are)."""
    if isinstance(value, dict):
        return bool(value)  # its names are text
    if isinstance(value, list):
        return any(_holds_text(item) for item in value)
    return isinstance(value, str)


@dataclass
class SimState:
    """All records of one simulator app, plus concurrency counters."""

    max_records: int = 10_000
    active: int = 0  # requests in progress now
    max_active: int = 0  # the peak of `active` since the last reset
    total: int = 0  # requests begun since the last reset
    _records: deque[SimRequest] = field(init=False)
    _changed: threading.Condition = field(init=False, default_factory=threading.Condition)

    def __post_init__(self) -> None:
        self._records = deque(maxlen=self.max_records)

    # -- written by the app --------------------------------------------------

    def begin(self, record: SimRequest) -> None:
        with self._changed:
            self._records.append(record)
            self.total += 1
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self._changed.notify_all()

    def mark(self) -> None:
        """Wake `wait_for` callers after a lifecycle step (first token, and the like)."""
        with self._changed:
            self._changed.notify_all()

    def end(self, record: SimRequest, outcome: Outcome) -> None:
        with self._changed:
            record.outcome = outcome
            record.finished_at = time.monotonic()
            self.active -= 1
            self._changed.notify_all()

    # -- read by tests and the HTTP views ------------------------------------

    def requests(self) -> list[SimRequest]:
        with self._changed:
            return list(self._records)

    def last(self) -> SimRequest | None:
        with self._changed:
            return self._records[-1] if self._records else None

    def reset(self) -> None:
        """Forget all records and counters. Running requests finish, unrecorded."""
        with self._changed:
            self._records.clear()
            self.total = 0
            self.max_active = self.active
            self._changed.notify_all()

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
        """Block until `predicate()` is true or `timeout` passes; return its last value.

        Lifecycle steps wake waiters at once. Per-chunk counters do not notify (that
        would take a lock per chunk), so the wait also re-checks every 10 ms.
        """
        deadline = time.monotonic() + timeout
        with self._changed:
            while not (ok := predicate()):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(min(left, 0.01))
            return ok
