"""The tool calls one stream carried, as the client would assemble them, and their outcomes.

Only streams that carry tool calls create one of these (the observer makes it at the first
tool-call piece), so a plain text stream pays nothing. Each API's seam reads its own wire
shape into `CallPiece`s (proxy/core/apis/): the call's index in the answer, whether the
piece opens the call (chat: the delta with `id` and `function.name`; Messages: a
`tool_use` content_block_start; Responses: a `function_call` output item; Cohere:
tool-call-start; Ollama: every call, whole in one piece), an argument piece, and whether
it closes the call (an API's explicit end of a call; chat has none).

Outcomes, one per call the client received (`outcome`): `truncated` when the call was
still being written as the stream ended (a choice's last call when that choice finished
for `length`, or when it was cut short before its finish, unless the API closed the call); else `unknown` when its arguments passed
MAX_ARGUMENT_BYTES (they are no longer kept, so they cannot be judged: never buffered
without limit); else `invalid_arguments` when the arguments are not a JSON object; else
`complete`. Beyond MAX_CALLS calls in one stream, further calls are counted as `unknown`.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
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
    choice: int = 0  # the answer's choice (chat with n > 1 numbers each choice's calls)


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
    """The calls of one stream, in the order they opened, by (choice, call index): vLLM
    streams each of n choices with its own tool parser, numbering its calls from 0
    (chat_completion/serving.py, one parser per choice, chunks tagged with its index)."""

    def __init__(self, now: float, *, timed: bool = True) -> None:
        self.first = now  # the first call's first delta
        self.timed = timed  # False: whole calls from a non-streaming body, no durations
        self.calls: dict[tuple[int, int], _Call] = {}
        self.order: list[tuple[int, int]] = []
        self.overflow = 0  # calls beyond MAX_CALLS

    def add(self, piece: CallPiece, now: float) -> None:
        key = (piece.choice, piece.call)
        call = self.calls.get(key)
        if call is not None and piece.opens and call.closed:
            if not (piece.closes and self.timed):
                return  # a repeated opening of a closed call says nothing new
            # In a stream, a whole call (opened and closed in one piece: Ollama sends each
            # call once, whole, proxy/core/apis/ollama.py) never continues a closed one: it
            # is another call with the same number. A body's whole calls come twice, made
            # here by the observer and then applied (proxy/core/observe.py, _parse_body).
            # Its key: a number below 0, which no API gives (they count from 0), new each time.
            key, call = (piece.choice, -1 - len(self.order)), None
        if call is None:
            if piece.closes and not piece.opens:
                return  # the end of a block that was no call (Messages content_block_stop)
            if len(self.calls) >= MAX_CALLS:
                self.overflow += piece.opens
                return
            call = self.calls[key] = _Call(now)
            self.order.append(key)
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

    def choices(self) -> set[int]:
        return {choice for choice, _ in self.order}

    def outcomes(
        self, *, length: AbstractSet[int], cut_short: AbstractSet[int]
    ) -> tuple[ToolCall, ...]:
        """Each call's outcome; `length`: the choices that finished for their token limit;
        `cut_short`: the choices that ended without their clean end (error, truncation,
        client gone). Either makes the choice's last call truncated; an open one only
        when cut short."""
        result: list[ToolCall] = []
        last = {key[0]: key for key in self.order}  # each choice's last call
        for key in self.order:
            call = self.calls[key]
            seconds = call.last - call.first if self.timed else None
            choice = key[0]
            if last[choice] == key and (
                choice in length or (choice in cut_short and not call.closed)
            ):
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
