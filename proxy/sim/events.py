"""Generate one Messages or Responses completion: the event-typed streams.

Chat and completions stream `data:` chunks (see `stream.py`); vLLM's Anthropic Messages
and OpenAI Responses layers stream named SSE events (`event: <name>\\ndata: <json>`)
around the same token schedule. One `EventWire` per request builds the bytes; this
module decides when they go out, with the same pacers, faults and records as chat:

  opening()        with the headers, at t~0 (message_start / response.created ...)
  block_start()    just before the first content delta, in its own write, as vLLM
                   opens its content block lazily on the first text it sees
  content(text)    one delta per chunk on the pacer's schedule
  closing(...)     right after the last token: the block/item end events, the usage
                   and stop events; the last one (message_stop, response.completed)
                   is left out under `x-sim-no-done`

Faults behave as in `stream.py`: `error_event` and `error_string` send the API's
in-stream error event and end the body; `reset`, `close_no_done`, `stall`,
`malformed`, `non_utf8` and `huge_event` are the same as on chat.
"""

from __future__ import annotations

import time
from typing import Protocol

from proxy.sim import wire
from proxy.sim.controls import ENDING_FAULTS, Plan, burn_cpu
from proxy.sim.exchange import Exchange
from proxy.sim.pacing import Pacer
from proxy.sim.state import Outcome
from proxy.sim.tokens import text_json

SSE = b"text/event-stream; charset=utf-8"
_NON_UTF8 = b"\xff\xfe"


class EventWire(Protocol):
    def opening(self) -> list[bytes]: ...

    def block_start(self) -> list[bytes]: ...

    def content(self, text: bytes) -> bytes:
        """A content delta; `text` is already escaped for the inside of a JSON string."""
        ...

    def closing(self, sent: int, started: bool) -> list[bytes]:
        """The events after the last token; `started`: a content block was opened."""
        ...

    def error(self, message: str) -> bytes: ...

    def full(self, sent: int) -> bytes:
        """The non-streamed JSON body."""
        ...

    @property
    def finish_reason(self) -> str | None:
        """The stop reason as this API puts it on the wire."""
        ...


async def stream_events(ex: Exchange, plan: Plan, events: EventWire, pacer: Pacer) -> Outcome:
    record = ex.record
    await ex.start(200, SSE)
    for data in events.opening():
        await ex.write(data)

    n, per_chunk = plan.output_tokens, plan.tokens_per_chunk
    pending = plan.fault
    sent = slots = 0
    started = False
    while sent < n:
        await (pacer.first() if slots == 0 else pacer.next())
        slots += 1
        if pending is not None and sent >= plan.fault_after:
            record.fault, pending = pending, None
            if not await _fire(ex, plan, events, pacer, record.fault):
                return "fault"
        count = min(per_chunk, n - sent)
        burn_cpu(plan.cpu_per_token * count)
        if not started:
            started = True
            for data in events.block_start():
                await ex.write(data)
        data = events.content(text_json(count, sent))
        sent += count
        record.completion_tokens = sent
        if record.first_token_at is None:
            record.first_token_at = time.monotonic()
        await ex.write(data)
    if pending is not None:
        await (pacer.first() if slots == 0 else pacer.next())
        slots += 1
        record.fault = pending
        if not await _fire(ex, plan, events, pacer, pending):
            return "fault"
    if slots == 0:
        await pacer.first()  # an empty completion still ends when its EOS token is due

    record.finish_reason = events.finish_reason
    closing = events.closing(sent, started)
    if plan.no_done:
        closing = closing[:-1]
    for data in closing[:-1]:
        await ex.write(data)
    outcome: Outcome = "fault" if record.fault else "completed"
    await ex.end(closing[-1] if closing else b"", outcome)
    return outcome


async def complete_events(ex: Exchange, plan: Plan, events: EventWire, pacer: Pacer) -> Outcome:
    """The non-streamed response: all tokens' time passes, then one JSON body."""
    chunks = -(-plan.output_tokens // plan.tokens_per_chunk)
    await pacer.first()
    per_chunk = plan.tokens_per_chunk
    for i in range(chunks):
        if i:
            await pacer.next()
        burn_cpu(plan.cpu_per_token * min(per_chunk, plan.output_tokens - i * per_chunk))
    ex.record.completion_tokens = plan.output_tokens
    ex.record.finish_reason = events.finish_reason
    ex.record.first_token_at = time.monotonic()  # the tokens leave with the body
    await ex.reply(200, events.full(plan.output_tokens))
    return "completed"


async def _fire(ex: Exchange, plan: Plan, events: EventWire, pacer: Pacer, fault: str) -> bool:
    """Inject `fault`; return whether the stream goes on."""
    if fault == "stall":
        await pacer.pause(plan.stall)
    elif fault == "malformed":
        await ex.write(wire.MALFORMED_EVENT)
    elif fault == "non_utf8":
        await ex.write(events.content(_NON_UTF8))
    elif fault == "huge_event":
        overhead = len(events.content(b""))
        await ex.write(events.content(b"x" * max(0, plan.huge_bytes - overhead)))
    elif fault == "error_event":
        await ex.end(events.error("Internal server error"), "fault")
    elif fault == "error_string":
        await ex.end(events.error("upstream generation failed"), "fault")
    elif fault == "close_no_done":
        await ex.end(b"", "fault")
    # "reset": send nothing more and leave the body unfinished.
    return fault not in ENDING_FAULTS
