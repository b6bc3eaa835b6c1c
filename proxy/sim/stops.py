"""vLLM's stop strings, applied to the simulator's programmed text (chat's and completions'
`stop`, and the Messages and Cohere routes' `stop_sequences`, which vLLM runs as chat's).

Source: vllm/v1/engine/detokenizer.py (BaseIncrementalDetokenizer: `update`,
`get_next_output_text`, `check_stop_strings`) and vllm/v1/engine/output_processor.py
(process_outputs: a matched string makes finish_reason "stop" and stop_reason the string).

- Stop strings are checked after each engine step, over the text that step added; the
  string that completes earliest wins. The output keeps the tokens up to the one that
  completes it (usage counts them); its text ends before the string
  (`include_stop_str_in_output`: after it).
- While stop strings are set (and not included in the output), the streamed text holds
  back its last `max(len(s)) - 1` characters until the output finishes, so that a string
  begun in one step and completed in a later one is never sent. A step whose text is all
  held back still sends its chunk, with empty text; the finishing chunk carries the rest.
- With `min_tokens`, strings are checked only once the output has more tokens than that,
  and only where they end in the text after the `min_tokens`th token (detokenizer.py
  `update`: `num_output_tokens() > min_tokens`, `stop_check_offset`).
"""

from __future__ import annotations

import sys
from bisect import bisect_left
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.sim import errors
from proxy.sim.tokens import VOCAB, completion_text


class StopError(ValueError):
    """A `stop` vLLM refuses: its 400, with this message."""


@dataclass(frozen=True, slots=True)
class Stops:
    strings: tuple[str, ...]
    include: bool = False  # include_stop_str_in_output

    @property
    def hold(self) -> int:
        """Characters the streamed text keeps back until the output finishes."""
        return 0 if self.include else max(len(s) for s in self.strings) - 1


@dataclass(frozen=True, slots=True)
class StopHit:
    string: str  # the stop string matched: the choice's stop_reason
    tokens: int  # tokens generated, the one that completes the string included
    text: str  # the output's whole text


def read_stops(stop: Any, include: bool) -> Stops | None:
    """The request's `stop` (a string or a list of them) as vLLM reads it, or None."""
    if stop is None or stop == []:
        return None
    strings = (stop,) if isinstance(stop, str) else stop
    if not isinstance(strings, list | tuple) or not all(isinstance(s, str) for s in strings):
        raise StopError("stop: Input should be a valid string or a list of strings")
    if not all(strings):
        raise StopError("stop cannot contain an empty string.")
    return Stops(tuple(strings), include)


def check_stop_sequences(stop: Any, max_strings: int) -> errors.ErrorReply | None:
    """The Anthropic and Cohere models' `stop_sequences` as vLLM's pydantic reads them,
    `Annotated[list[str], Field(max_length=VLLM_MAX_STOP_STRINGS)] | None`
    (anthropic/protocol.py:224-226, cohere/protocol.py:156-158): the validation handler's
    400 (in OpenAI's shape on every route; Cohere's middleware then rewrites it), or None.
    A valid list goes to chat as `stop` (anthropic/serving.py:616, cohere/serving.py:558),
    where SamplingParams refuses an empty string (read_stops)."""
    if stop is None:
        return None
    loc = "body.stop_sequences"
    if not isinstance(stop, list):
        given = errors.error_input(stop)
        err = {"type": "list_type", "loc": loc, "msg": "Input should be a valid list"}
        return errors.validation_error(loc, [{**err, "input": given}])
    if len(stop) > max_strings:
        return errors.list_too_long("stop_sequences", len(stop), max_strings)
    bad = [
        {
            "type": "string_type",
            "loc": f"{loc}.{i}",
            "msg": "Input should be a valid string",
            "input": errors.error_input(s),
        }
        for i, s in enumerate(stop)
        if not isinstance(s, str)
    ]
    return errors.validation_error(str(bad[0]["loc"]), bad) if bad else None


def first_stop(stops: Stops, tokens: int, per_step: int, min_tokens: int = 0) -> StopHit | None:
    """Where a stop string ends a generation of `tokens` tokens that comes `per_step`
    tokens an engine step, or None if none of them occurs."""
    n = len(VOCAB)
    # The text repeats every len(VOCAB) tokens and every token has a character at least,
    # so a string that has not completed by then never will.
    horizon = min_tokens + n + max(len(s) for s in stops.strings) + per_step
    text = ""
    for start in range(0, min(tokens, horizon), per_step):
        offsets = [len(text)]
        for i in range(start, min(start + per_step, tokens)):
            text += VOCAB[i % n]
            offsets.append(len(text))
        if start + len(offsets) - 1 <= min_tokens:
            continue
        hit = _check(text, len(text) - offsets[max(min_tokens - start, 0)], stops)
        if hit is None:
            continue
        string, truncate_to = hit
        end = len(text) if truncate_to == -1 else truncate_to
        if not stops.include:
            end += len(string)
        kept = bisect_left(offsets, end, lo=1)
        return StopHit(string, start + kept, text if truncate_to == -1 else text[:truncate_to])
    return None


def _check(text: str, new_chars: int, stops: Stops) -> tuple[str, int] | None:
    """detokenizer.py check_stop_strings: (the string, where the text is cut or -1)."""
    if not new_chars:
        return None
    best, best_index, best_end = None, 0, sys.maxsize
    for string in stops.strings:
        index = text.find(string, 1 - new_chars - len(string))
        if index != -1 and index + len(string) < best_end:
            best, best_index, best_end = string, index, index + len(string)
    if best is None:
        return None
    if stops.include:
        return best, -1 if best_end >= len(text) else best_end
    return best, best_index


class HeldText:
    """The text of each step of one choice as vLLM streams it while stop strings are set."""

    __slots__ = ("_chars", "_hold", "_sent", "_text")

    def __init__(self, stops: Stops, hit: StopHit | None, tokens: int) -> None:
        self._text = hit.text if hit is not None else completion_text(tokens)
        self._hold = stops.hold
        self._chars = 0  # characters generated so far
        self._sent = 0  # characters streamed so far

    def step(self, count: int, sent: int, finished: bool) -> bytes:
        """The text of the step that adds tokens `sent .. sent+count-1`, JSON-escaped."""
        n = len(VOCAB)
        self._chars += sum(len(VOCAB[i % n]) for i in range(sent, sent + count))
        return self.rest() if finished else self._upto(self._chars - self._hold)

    def rest(self) -> bytes:
        """Everything not streamed yet: the finishing chunk's text."""
        return self._upto(len(self._text))

    def _upto(self, end: int) -> bytes:
        if end <= self._sent:
            return b""
        piece, self._sent = self._text[self._sent : end], end
        return orjson.dumps(piece)[1:-1]
