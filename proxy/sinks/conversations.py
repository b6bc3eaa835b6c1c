"""The conversation tracker: the table of proxy/core/conversations.py wired to requests.

The dispatcher (proxy/sinks/dispatch.py) calls `begin` when a measured request starts
and `end` with its record when it ends: twice per request, never per chunk. `end`
returns the record with its conversation fields filled in, before any sink sees it, and
observes the per-continuation metrics; conversations that went idle are observed by a
sweep at each `begin` and by a loop timer armed while the table holds any.

Other sinks that report closed conversations (the OTLP metrics) are `ClosedListener`s:
the sweep hands each the conversations it closed, after the Prometheus metrics saw them;
a listener that fails is logged and counted (measurement failures, stage sink), and the
others still run.

A request the client got an error status for (`refused`) is no turn: its record keeps the
id of the conversation it addressed, with no turn, no continuation and no gap, and no
continuation metric counts it.

Times are wall-clock seconds: the record's `started_at`, and `started_at + e2e` for its
end, so a gap is measured between two instants of the same clock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from proxy.core.conversations import Closed, Conversations, Turn, header_refusal
from proxy.core.fingerprint import chain_of
from proxy.core.measurement import ErrorType, Measurement
from proxy.core.request import RequestInfo
from proxy.sinks.metrics import Metrics
from proxy.sinks.sink import Headers

log = logging.getLogger("tokenprobe")

#: The sweep timer's period is a quarter of the idle time, within these bounds.
SWEEP_MIN, SWEEP_MAX = 0.05, 10.0


def refused(m: Measurement) -> bool:
    """The client received an error status (4xx, 5xx: the backend's, or the proxy's 502 or
    504) instead of an answer: nothing was generated for it, no exchange happened. Not a
    200 stream that failed or was cut (what it generated was relayed: a turn that failed),
    nor a request the client left before its answer came (status 0, client_cancelled)."""
    error = m.error_type
    return error is not None and error is not ErrorType.CLIENT_CANCELLED and m.status_code >= 400


@runtime_checkable
class ClosedListener(Protocol):
    """A sink that also reports conversations when they close."""

    def conversations_closed(self, closed: Sequence[Closed]) -> None: ...


class ConversationTracker:
    def __init__(
        self,
        table: Conversations,
        metrics: Metrics,
        *,
        header: str | None = None,
        miss_ratio: float = 0.5,
        listeners: Sequence[ClosedListener] = (),
    ) -> None:
        self.table = table
        self.listeners = tuple(listeners)
        self.metrics = metrics
        self.header = None if header is None else header.lower().encode()
        self.miss_ratio = miss_ratio
        self._timer: asyncio.TimerHandle | None = None
        self._period = min(SWEEP_MAX, max(SWEEP_MIN, table.idle / 4))

    def begin(self, info: RequestInfo, headers: Headers, now: float) -> Turn:
        self.sweep(now)
        value = self._header_value(headers)
        chain, complete = chain_of(info)
        turn = self.table.begin(
            now,
            header=value,
            previous_response_id=info.previous_response_id,
            chain=chain,
            complete=complete,
        )
        self._count_evictions()
        self.metrics.conversations_open.set(len(self.table))
        self._arm()
        return turn

    def end(self, turn: Turn, m: Measurement, model_label: str) -> Measurement:
        """The request of `turn` ended: the table learns it, the record gets its fields."""
        refusal = refused(m)
        turn = self.table.end(
            turn,
            m.started_at + m.e2e,
            duration=m.e2e,
            response_id=m.response_id,
            prompt_tokens=m.prompt_tokens,
            failed=not m.ok,
            refused=refusal,
        )
        # A refusal may have forgotten the conversation it alone opened, a retry moved out
        # of the branch it had opened: the table can shrink at an end too.
        self.metrics.conversations_open.set(len(self.table))
        continued = not refusal and turn.via in ("header", "previous_response", "messages")
        # Filled in, not copied: no sink has seen this request's record yet (Measurement).
        m.conversation_id = turn.id
        m.conversation_named = turn.conversation.named
        m.turn = None if refusal else turn.index
        m.continued_via = turn.via if continued else None
        m.turn_gap = turn.gap if continued else None
        m.shared_prefix_tokens = turn.shared_prefix_tokens if continued else None
        if continued:
            metrics = self.metrics
            metrics.conversation_continuations.labels(model_label, turn.via).inc()
            if turn.gap is not None:
                metrics.conversation_turn_gap.labels(model_label, turn.via).observe(turn.gap)
            ratio = m.continuation_cache_ratio()
            if ratio is not None:
                metrics.continuation_cached_ratio.labels(model_label).observe(ratio)
                # Resolved on every measured continuation: its zero is a series, so the
                # share of misses is 0, not absent, while nothing misses.
                misses = metrics.continuation_cache_misses.labels(model_label)
                if ratio < self.miss_ratio:
                    misses.inc()
        return m

    def sweep(self, now: float) -> list[Closed]:
        """Observe the conversations idle since `idle` seconds before `now`."""
        closed = self.table.sweep(now)
        metrics = self.metrics
        for c in closed:
            metrics.conversation_turns.observe(c.turns)
            metrics.conversation_duration.observe(c.duration)
            metrics.conversation_model_time.observe(c.model_seconds)
            metrics.conversation_between_time.observe(c.between_seconds)
        if closed:
            metrics.conversations_open.set(len(self.table))
            for listener in self.listeners:
                try:
                    listener.conversations_closed(closed)
                except Exception:
                    log.exception("a sink failed to record closed conversations")
                    metrics.measurement_failures.labels("sink").inc()
        return closed

    def _count_evictions(self) -> None:
        evicted = self.table.evicted
        if evicted:
            self.metrics.conversation_evictions.inc(evicted)
            self.table.evicted = 0

    def _header_value(self, headers: Headers) -> bytes | None:
        name = self.header
        if name is None:
            return None
        for key, value in headers:
            if key == name and value:
                reason = header_refusal(value)
                if reason is None:
                    return value
                self.metrics.conversation_header_refused.labels(reason).inc()
                return None
        return None

    def _arm(self) -> None:
        """A timer that sweeps while the table holds conversations, so the last one of a
        quiet proxy is observed too."""
        if self._timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a record made outside a server): begin sweeps
            return
        self._timer = loop.call_later(self._period, self._tick)

    def _tick(self) -> None:
        self._timer = None
        try:
            self.sweep(time.time())
        except Exception:
            log.exception("sweeping idle conversations failed")
        if len(self.table):
            self._arm()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
