"""Generate one Messages or Responses completion: the event-typed streams.

Chat and completions stream `data:` chunks (see `stream.py`); vLLM's Anthropic Messages
and OpenAI Responses layers stream named SSE events (`event: <name>\\ndata: <json>`)
around the same token schedule. One `EventWire` per request builds the bytes; this
module decides when they go out, with the same pacers, faults and records as chat:

  opening()        with the headers, at t~0: Responses' response.created and
                   response.in_progress (responses/serving.py responses_stream_generator
                   yields them before it reads the engine's first output)
  first_output()   with the first engine output (the first token, an empty answer's
                   EOS, a fault's event at that slot): Messages' message_start (and
                   x-sim-ping's ping), Cohere's message-start. vLLM builds them from the
                   chat stream's first chunk, the role chunk, which chat sends with its
                   first engine output (anthropic/serving.py message_stream_converter,
                   `first_item`; cohere/serving.py _chat_completion_stream_to_v2,
                   `state.started`; chat_completion/serving.py `first_iteration`); a
                   stall delays them, a cut there (close_no_done, reset) never sends them.
                   `x-sim-early-role: 1` (SimConfig.early_role) sends them with the
                   headers instead, as it does chat's role chunk
  block_start()    just before the first content delta, in its own write, as vLLM
                   opens its content block lazily on the first text it sees
  content(text)    one delta per chunk on the pacer's schedule
  closing(...)     right after the last token: the block/item end events, the usage
                   (which counts the EOS that ends the text: controls.Plan.eos) and
                   stop events; the last one (message_stop, response.completed)
                   is left out under `x-sim-no-done`

Stop strings (the Messages and Cohere routes' `stop_sequences`, run as chat's `stop`) hold
text back as chat does (proxy/sim/stops.py HeldText); both converters drop a chat chunk
whose text is empty, so a step whose text is all held back sends nothing, the content
block opens with the first text sent, and what is still held when the answer ends goes in
one last delta (with the finishing token's, or at the EOS's step).

Faults behave as in `stream.py`: `error_event` and `error_string` send the API's
in-stream error event and end the body; `reset`, `close_no_done`, `stall`,
`malformed`, `non_utf8` and `huge_event` are the same as on chat.
"""

from __future__ import annotations

from typing import Protocol

from proxy.sim import wire
from proxy.sim.controls import ENDING_FAULTS, Plan
from proxy.sim.exchange import Exchange
from proxy.sim.pacing import Pacer
from proxy.sim.state import Outcome
from proxy.sim.stops import HeldText
from proxy.sim.stream import SILENT_FAULTS, paced_content, paced_whole
from proxy.sim.tokens import text_json

SSE = b"text/event-stream; charset=utf-8"
_NON_UTF8 = b"\xff\xfe"


class EventWire(Protocol):
    def opening(self) -> list[bytes]:
        """The events sent with the headers."""
        ...

    def first_output(self) -> list[bytes]:
        """The events sent with the first engine output, before its own."""
        ...

    def block_start(self) -> list[bytes]: ...

    def content(self, text: bytes) -> bytes:
        """A content delta; `text` is already escaped for the inside of a JSON string."""
        ...

    def closing(self, sent: int, started: bool) -> list[bytes]:
        """The events after the last of `sent` text tokens; `started`: a content block was
        opened. The usage adds the plan's EOS."""
        ...

    def error(self, chat_error: bytes) -> bytes:
        """The API's in-stream error where vLLM's chat stream, which the API's layer runs,
        sends `chat_error` (wire.ERROR_EVENT, wire.ERROR_STRING_EVENT)."""
        ...

    def full(self, sent: int) -> bytes:
        """The non-streamed JSON body of `sent` text tokens (the usage adds the EOS)."""
        ...

    @property
    def finish_reason(self) -> str | None:
        """The stop reason as this API puts it on the wire."""
        ...


async def stream_events(ex: Exchange, plan: Plan, events: EventWire, pacer: Pacer) -> Outcome:
    record = ex.record
    await ex.start(200, SSE)
    now, held_start = events.opening(), events.first_output()
    if plan.early_role:
        now, held_start = now + held_start, []
    for data in now:
        await ex.write(data)

    def first() -> list[bytes]:
        """The first-output events not yet sent: they go before whatever is sent next."""
        nonlocal held_start
        out, held_start = held_start, []
        return out

    # The token limit and a stop string end the answer at a token with text, as does an
    # EOS in the last text step: that step's chat chunk carries all that was held back
    # (as in stream.py; vLLM 0.32, greedy "\n" tokens, `stop_sequences: ["\nX"]`,
    # max_tokens 4: deltas "\n", "\n", "\n\n").
    ends_on_token = (
        plan.finish_reason == "length" or plan.stop_hit is not None or plan.eos_shares_step
    ) and plan.output_tokens > 0
    held = None if plan.stops is None else HeldText(plan.stops, plan.stop_hit, plan.output_tokens)
    started = False

    def delta(text: bytes) -> list[bytes]:
        # vLLM opens the content block lazily, on the first text it sees (built first:
        # the events are numbered as they are made), and sends no delta for empty text.
        nonlocal started
        if not text:
            return []
        opening = [] if started else events.block_start()
        started = True
        return [*opening, events.content(text)]

    def content(count: int, sent: int) -> list[bytes]:
        # The first step is the first engine output even when its text is all held back:
        # vLLM's role chunk, hence message_start, goes out with it regardless.
        if held is None:
            return first() + delta(text_json(count, sent))
        ends = ends_on_token and sent + count >= plan.output_tokens
        return first() + delta(held.step(count, sent, ends))

    async def fire(fault: str) -> bool:
        if fault not in SILENT_FAULTS:  # an event at the slot: the start events go first
            for data in first():
                await ex.write(data)
        return await _fire(ex, plan, events, pacer, fault)

    sent = await paced_content(ex, plan, pacer, content, fire)
    if sent is None:
        return "fault"
    # An empty answer: its EOS is the first engine output, the start events go with it.
    for data in first() + delta(b"" if held is None else held.rest()):  # the EOS's text
        await ex.write(data)
    record.finish_reason = events.finish_reason
    record.completion_tokens = sent + plan.eos  # the EOS, sent as the closing events
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
    await paced_whole(ex, plan, pacer, events.finish_reason)
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
        await ex.end(events.error(wire.ERROR_EVENT), "fault")
    elif fault == "error_string":
        await ex.end(events.error(wire.ERROR_STRING_EVENT), "fault")
    elif fault == "close_no_done":
        await ex.end(b"", "fault")
    # "reset": send nothing more and leave the body unfinished.
    return fault not in ENDING_FAULTS
