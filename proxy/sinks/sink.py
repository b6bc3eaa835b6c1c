"""What a sink is: one method, `record(measurement, labels)`, called once per finished request.

Every sink (Prometheus metrics, the access log, cost, a test's recorder) takes the same
record, which it reads and never changes, and the same bounded labels, resolved once per
request by `Sinks`; none of them sees a header, a raw model name as a label, or another
sink's failure. Adding a sink is a class with this method plus one line in
proxy/server/assemble.py.

A sink that also reports WebSocket sessions is a `SessionSink` as well: `session(record)`,
called once per tunnel when it ends (proxy/core/wsrecord.py); `Sinks` finds those among its
sinks and catches their failures as it catches `record`'s.

A sink that counts tokens is a `LateTokensSink` too: `late_tokens(tokens, labels)`, called
when a background Response's tokens are counted after its POST's record (proxy/core/
background.py: the first retrieval that sees it finished), with the POST's labels; only
the token counters move (Prometheus, OTLP), and the access log writes a line of its own.

The tracer is the one part with two steps: a span must start when the request does (its
trace headers go upstream), so it has `start` and `finish` instead of `record`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from proxy.core.background import LateTokens
from proxy.core.measurement import Measurement
from proxy.core.request import RequestInfo
from proxy.core.wsrecord import WsSessionRecord

Headers = list[tuple[bytes, bytes]]


@dataclass(frozen=True, slots=True)
class Labels:
    """A request's label values from closed sets, never the client's raw strings."""

    model: str  # bounded by ModelLabels: an allowlisted or upstream-listed id, else "other"
    key: str | None = None  # a salted hash bounded by KeyLabels; None without --key-label hash
    # One value per --label-header label, in the order given (HeaderLabels bounds them).
    attribution: tuple[str, ...] = ()


class Sink(Protocol):
    def record(self, measurement: Measurement, labels: Labels) -> None:
        """Consume one finished request; runs on the event loop, so keep it short. An
        exception is logged and counted by `Sinks`, and never reaches the request."""


@runtime_checkable
class HeldBackSink(Protocol):
    def shutdown(self) -> None:
        """Send what is held back (an exporter's last interval) and close. Blocking and
        idempotent; the app's shutdown calls it in a thread, after the drain."""


@runtime_checkable
class SessionSink(Protocol):
    def session(self, record: WsSessionRecord) -> None:
        """Consume one finished WebSocket session; on the event loop, like `record`."""


@runtime_checkable
class LateTokensSink(Protocol):
    def late_tokens(self, tokens: LateTokens, labels: Labels) -> None:
        """A background Response's tokens, counted after its POST's record with the POST's
        labels; on the event loop, like `record`."""


class RequestTracer(Protocol):
    def start(
        self, info: RequestInfo, headers: Headers, start_time_ns: int | None = None
    ) -> tuple[Any, str | None, Headers]:
        """Open a span that began at start_time_ns (wall clock): (span, trace id if
        sampled, trace headers to send upstream in place of the client's)."""

    def finish(self, span: Any, measurement: Measurement | None) -> None: ...

    def shutdown(self) -> None:
        """Flush what is queued; blocking, called off the event loop at exit."""


class Recorder:
    """A sink that keeps every record in memory, in order: the demo's table, tests."""

    def __init__(self) -> None:
        self.records: list[Measurement] = []
        self.sessions: list[WsSessionRecord] = []
        self.late: list[LateTokens] = []

    def record(self, measurement: Measurement, labels: Labels) -> None:
        self.records.append(measurement)

    def session(self, record: WsSessionRecord) -> None:
        self.sessions.append(record)

    def late_tokens(self, tokens: LateTokens, labels: Labels) -> None:
        self.late.append(tokens)
