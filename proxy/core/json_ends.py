"""A JSON answer too large to keep whole, read from its two ends.

A whole answer (not streamed) is parsed once it has ended. One larger than the observer
keeps (proxy/core/observe.py MAX_KEPT_BODY) is relayed in full all the same, and only its
ends are kept (`BodyEnds`): its first HEAD_BYTES, and a window of its last TAIL_BYTES that
moves on as the body comes. What makes an answer large is one member, its generated
content or its vectors, and what the record needs lies before it (`id`, `model`) or after
it. vLLM writes its response models' fields in order: `id, object, created, model,
choices, service_tier, system_fingerprint, usage, ..., metrics` (vLLM 0.32:
vllm/entrypoints/openai/chat_completion/protocol.py ChatCompletionResponse, and
completion/protocol.py CompletionResponse), `id, object, created, model, data, usage`
(pooling/embed/protocol.py EmbeddingResponse), `content, model, stop_reason,
stop_sequence, usage` (anthropic/protocol.py AnthropicMessagesResponse), `output, ...,
status, text, top_logprobs, truncation, usage` (openai/responses/protocol.py
ResponsesResponse); llama-server writes its `timings` last, Ollama its counts.

`read` gives the top-level members either end holds whole, as one object for the API's
`body` parser. The member both ends are cut in stands in as a list where it is one at both
ends, holding its last element's whole members where that is an object: a chat or
completions choice ends with its `finish_reason` (ChatCompletionResponseChoice: index,
message, logprobs, finish_reason, stop_reason, token_ids), which so comes in without its
message; an Ollama embedding answer's `embeddings` is still a list. That the member the
head is cut in is the one the tail is cut in holds for an answer with one large member,
the answers this is for; a body with two (vLLM's `prompt_logprobs` after the usage) has
its usage in the middle, unread, and its stand-in holds no choice: no finish either.
Nothing else of the middle is known: no text, no reasoning, no tool call.

The tail's window may begin inside a string. A quote delimits a string unless an odd run
of backslashes comes just before it, which the window shows (but at its first byte), and
from the body's end, outside any string, the delimiters alternate closing, opening: so
the window is read from the first byte known to be outside a string. From there each
level of the members open there is walked to its close, one whole member or element at a
time, each skipped by json's C scanner (no Python loop over a value's bytes): both ends
of a chat answer with logprobs or of a batch of embeddings in about 2 ms, twice what orjson
takes for the megabyte an answer may have whole, a tenth of parsing 8 MiB.
"""

from __future__ import annotations

import json
import re
from collections import deque
from json.decoder import scanstring  # type: ignore[attr-defined]
from typing import Any

import orjson

#: How much of an answer's start is kept: its identity, and of an error body as much as an
#: error is read from (proxy/core/errors.py MAX_ERROR_BODY).
HEAD_BYTES = 64 * 1024
#: How much of an answer's end is kept: its usage, and what else comes after its large
#: member.
TAIL_BYTES = 64 * 1024

_DECODER = json.JSONDecoder()
#: What reading ends that are no JSON raises: JSONDecodeError is a ValueError; json's C
#: scanner gives up on nesting deeper than the interpreter's recursion limit.
_NO_JSON = (ValueError, IndexError, RecursionError)
_SPACE = re.compile(r"[ \t\n\r]*")
# A whole string (skipped), a quote that opens a string never closed, a bracket or comma.
_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|"|[\[\]{},]', re.S)


class BodyEnds:
    """The two ends of an answer too large to keep whole (the module's doc). The tail is a
    window of reads, the oldest let go once the later ones fill it, so an answer holds at
    most HEAD_BYTES, TAIL_BYTES and one read, however large it is."""

    __slots__ = ("_held", "_tail", "head")

    def __init__(self, kept: list[bytes]) -> None:
        """`kept`: the answer's reads so far, once they passed what is kept whole."""
        body = b"".join(kept)
        self.head = body[:HEAD_BYTES]
        last = body[-TAIL_BYTES:]
        self._tail: deque[bytes] = deque((last,))
        self._held = len(last)

    def feed(self, chunk: bytes) -> None:
        tail = self._tail
        if len(chunk) >= TAIL_BYTES:
            tail.clear()
            chunk, self._held = chunk[-TAIL_BYTES:], 0
        tail.append(chunk)
        self._held += len(chunk)
        while self._held - len(tail[0]) >= TAIL_BYTES:
            self._held -= len(tail.popleft())

    def tail(self) -> bytes:
        return b"".join(self._tail)[-TAIL_BYTES:]

    def read(self) -> dict[str, Any] | None:
        return read(self.head, self.tail())


def read(head: bytes, tail: bytes) -> dict[str, Any] | None:
    """The members of a JSON object that its `head` or its `tail` holds whole (the
    module's doc); None when the tail holds none: no object's end, or one member longer
    than the window."""
    try:
        back = _tail_members(tail)
    except _NO_JSON:
        return None
    if back is None:
        return None
    members, stand_in = back
    try:
        front = _head_members(head)
    except _NO_JSON:
        front = None
    if front is None:
        return members
    obj, cut = front
    obj.update(members)
    if cut is not None and stand_in is not None and cut not in obj:
        obj[cut] = stand_in
    return obj


def _head_members(head: bytes) -> tuple[dict[str, Any], str | None] | None:
    """The whole members at the start of an object, and the name of the member the head
    is cut in where its value is a list (else None); None for no object's start."""
    text = _text(head)
    if text is None:
        return None
    pos = _skip(text, 0)
    if text[pos : pos + 1] != "{":
        return None
    last = pos  # where the whole members end: the `{`, or the comma after the last
    while True:
        start = _skip(text, last + 1)
        try:
            end = _skip(text, _member_end(text, start))
        except (ValueError, IndexError):  # the member the head is cut in
            break
        if end == len(text):  # whole up to here, its end unseen ("created": 17 may go on)
            break
        if text[end] != ",":
            return None  # the whole object, or no JSON: no answer this large
        last = end
    members = _object(text[pos:last] + "}") if last > pos else {}
    if members is None:
        return None
    return members, _name_of_list(text, _skip(text, last + 1))


def _member_end(text: str, start: int) -> int:
    """The end of the member (name, colon and value) that begins at `start`."""
    if text[start] != '"':
        raise ValueError("no member's name")
    _, colon = scanstring(text, start + 1)
    colon = _skip(text, colon)
    if text[colon] != ":":
        raise ValueError("no colon after a member's name")
    _, end = _DECODER.raw_decode(text, _skip(text, colon + 1))
    return int(end)


def _name_of_list(text: str, start: int) -> str | None:
    """The name of the member at `start` where its value opens a list (the head cut it)."""
    if text[start : start + 1] != '"':
        return None
    try:
        name, colon = scanstring(text, start + 1)
    except ValueError:
        return None
    colon = _skip(text, colon)
    value = _skip(text, colon + 1)
    return name if text[colon : colon + 1] == ":" and text[value : value + 1] == "[" else None


class _Level:
    """One container open where the tail's window begins, as the walk finds it: where its
    first whole member or element in the window begins (after its first comma), where its
    last whole one does, where it closes and with what."""

    __slots__ = ("close", "first", "kind", "last")

    def __init__(self) -> None:
        self.first: int | None = None
        self.last: int | None = None
        self.close = -1
        self.kind = ""


def _tail_members(window: bytes) -> tuple[dict[str, Any], list[Any] | None] | None:
    """The whole members at the end of an object; and the stand-in for the member the
    window is cut in where that is a list: its last element's whole members where that is
    an object, else empty (None where it is no list)."""
    text = _text(window[_outside_strings(window) :].rstrip())
    if not text or text[-1] != "}":
        return None
    levels = _levels(text)
    if levels is None:
        return None
    top = levels[-1]
    if top.first is None or top.kind != "}":
        return None
    members = _object("{" + text[top.first :])
    if members is None or len(levels) < 2 or levels[-2].kind != "]":
        return None if members is None else (members, None)
    return members, _last_element(text, levels[-2], levels[-3] if len(levels) > 2 else None)


def _last_element(text: str, within: _Level, cut: _Level | None) -> list[Any]:
    """The stand-in for a list the window is cut in (`within`): its last element whole, or
    the whole members of the element the window is cut in (`cut`), where it is an object."""
    if within.last is not None:
        element = _value(text[within.last : within.close])
    elif cut is not None and cut.kind == "}":
        element = {} if cut.first is None else _object("{" + text[cut.first : cut.close + 1])
    else:
        element = None
    return [element] if type(element) is dict else []


def _levels(text: str) -> list[_Level] | None:
    """The containers open at the start of `text` (which is outside a string), innermost
    first, each walked to its close: the start's own value is read up to its container's
    first comma or close, then each level's members or elements are skipped whole. The
    last level is the one that closes at the end."""
    pos = _first_mark(text)
    if pos is None:
        return None
    levels = [_Level()]
    while True:
        level = levels[-1]
        mark = text[pos]
        if mark == ",":
            start = _skip(text, pos + 1)
            if level.first is None:
                level.first = start
            level.last = start
            pos = _skip(text, _item_end(text, start))
        elif mark in "]}":
            level.close, level.kind = pos, mark
            pos = _skip(text, pos + 1)
            if pos == len(text):
                return levels
            levels.append(_Level())
        else:
            return None


def _first_mark(text: str) -> int | None:
    """Where the value `text` begins inside ends: the first comma or closing bracket of the
    container it is in."""
    depth = 0
    for match in _TOKENS.finditer(text):
        at = match.start()
        if match.end() - at > 1:
            continue  # a whole string
        mark = text[at]
        if mark in "[{":
            depth += 1
        elif depth and mark in "]}":
            depth -= 1
        elif mark == '"':
            return None  # a string never closed
        elif not depth:
            return at
    return None


def _item_end(text: str, start: int) -> int:
    """The end of the member or element that begins at `start`."""
    if text[start] == '"':
        _, end = scanstring(text, start + 1)
        if text[_skip(text, end) : _skip(text, end) + 1] != ":":
            return int(end)  # an element that is a string
        return _member_end(text, start)
    _, end = _DECODER.raw_decode(text, start)
    return int(end)


def _outside_strings(window: bytes) -> int:
    """The first position of `window`, the end of a JSON text, known to be outside any
    string. A quote at its very start, after no byte or backslashes alone, may be escaped
    by a backslash before the window, so only what follows it is read; then the count of
    quotes that delimit strings says whether the first of them closes a string opened
    before the window. Byte searches, not a pattern tried at each of 64 KiB (3 ms)."""
    lead = len(window) - len(window.lstrip(b"\\"))
    start = lead + 1 if window[lead : lead + 1] == b'"' else 0
    escaped, at = 0, window.find(b'\\"', start)
    while at >= 0:
        escaped += _backslashes(window, at, start) % 2
        at = window.find(b'\\"', at + 2)
    if (window.count(b'"', start) - escaped) % 2 == 0:
        return start
    at = window.find(b'"', start)
    while _backslashes(window, at - 1, start) % 2:
        at = window.find(b'"', at + 1)
    return at + 1


def _backslashes(data: bytes, end: int, start: int) -> int:
    """The run of backslashes that ends at `end`, back to `start` at most."""
    pos = end
    while pos >= start and data[pos] == 0x5C:
        pos -= 1
    return end - pos


def _text(data: bytes) -> str | None:
    """`data` as text, less a character its end cuts in two; None where it is no UTF-8."""
    try:
        return data.decode()
    except UnicodeDecodeError as error:
        cut = error.start if error.end == len(data) else -1
    try:
        return data[:cut].decode() if cut >= 0 else None
    except UnicodeDecodeError:
        return None


def _skip(text: str, pos: int) -> int:
    match = _SPACE.match(text, pos)
    return pos if match is None else match.end()


def _object(text: str) -> dict[str, Any] | None:
    value = _value(text)
    return value if type(value) is dict else None


def _value(text: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return None


__all__ = ["HEAD_BYTES", "TAIL_BYTES", "BodyEnds", "read"]
