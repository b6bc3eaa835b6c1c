"""The tool calls one stream carried, as the client would assemble them, and their outcomes.

Only streams that carry tool calls create one of these (the observer makes it at the first
tool-call piece), so a plain text stream pays nothing. Each API's seam reads its own wire
shape into `CallPiece`s (proxy/core/apis/): the call's index in the answer, whether the
piece opens the call (chat: the delta with `id` and `function.name`; Messages: a
`tool_use` content_block_start; Responses: a `function_call` output item; Cohere:
tool-call-start), an argument piece, and whether it closes the call (an API's explicit end
of a call; chat has none).

Outcomes, one per call the client received (`outcome`): `truncated` when the call was
still being written as the stream ended (the last call of a `length` finish, or the last
call, unless closed, of a stream cut short); else `unknown` when its arguments passed
MAX_ARGUMENT_BYTES (they are no longer kept, so they cannot be judged: never buffered
without limit); else `invalid_arguments` when the arguments are not a JSON object; else
`complete`. Beyond MAX_CALLS calls in one stream, further calls are counted as `unknown`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import orjson

#: The most argument bytes kept per call for the JSON check (1 MiB); beyond it: `unknown`.
MAX_ARGUMENT_BYTES = 1 << 20
#: The most calls of one stream followed one by one; later ones are counted as `unknown`.
MAX_CALLS = 64

OUTCOMES = ("complete", "invalid_arguments", "truncated", "unknown")


class CallPiece(NamedTuple):
    call: int  # the call's index in the answer, as the API numbers it
    opens: bool  # the call's first delta (id / name)
    arguments: str  # an argument piece ("" when the piece carries none)
    closes: bool = False  # the API says the call's arguments are complete


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call as the record keeps it."""

    outcome: str  # one of OUTCOMES
    arguments_seconds: float | None  # its first delta to its last argument piece (or close)


class _Call:
    __slots__ = ("closed", "first", "last", "parts", "size")

    def __init__(self, now: float) -> None:
        self.first = now
        self.last = now
        self.parts: list[str] | None = []  # None once over MAX_ARGUMENT_BYTES
        self.size = 0
        self.closed = False


class ToolCalls:
    """The calls of one stream, in the order they opened."""

    def __init__(self, now: float) -> None:
        self.first = now  # the first call's first delta
        self.calls: dict[int, _Call] = {}
        self.order: list[int] = []
        self.overflow = 0  # calls beyond MAX_CALLS

    def add(self, piece: CallPiece, now: float) -> None:
        call = self.calls.get(piece.call)
        if call is None:
            if piece.closes and not piece.opens:
                return  # the end of a block that was no call (Messages content_block_stop)
            if len(self.calls) >= MAX_CALLS:
                self.overflow += piece.opens
                return
            call = self.calls[piece.call] = _Call(now)
            self.order.append(piece.call)
        elif piece.opens and call.closed:
            return  # a repeated opening of a closed call says nothing new
        text = piece.arguments
        if text:
            call.last = now
            parts = call.parts
            if parts is not None:
                call.size += len(text)
                if call.size > MAX_ARGUMENT_BYTES:
                    call.parts = None  # over the bound: forget, judge as unknown
                else:
                    parts.append(text)
        if piece.closes:
            call.closed = True
            call.last = max(call.last, now)

    def outcomes(self, *, length: bool, cut_short: bool) -> tuple[ToolCall, ...]:
        """Each call's outcome; `length`: the stream finished for its token limit;
        `cut_short`: it ended without its clean end (error, truncation, client gone)."""
        result: list[ToolCall] = []
        last = self.order[-1] if self.order else None
        for index in self.order:
            call = self.calls[index]
            seconds = call.last - call.first
            if index == last and (length or (cut_short and not call.closed)):
                outcome = "truncated"
            elif call.parts is None:
                outcome = "unknown"
            else:
                outcome = "complete" if is_json_object("".join(call.parts)) else "invalid_arguments"
            result.append(ToolCall(outcome, seconds))
        result.extend(ToolCall("unknown", None) for _ in range(self.overflow))
        return tuple(result)


def is_json_object(text: str) -> bool:
    try:
        return type(orjson.loads(text)) is dict
    except orjson.JSONDecodeError:
        return False
