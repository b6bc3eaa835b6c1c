"""Removes the usage-only event that the proxy itself asked for, and nothing else.

When the client streamed without `stream_options.include_usage`, the proxy asks for usage
upstream so token counts come from the backend. The backend then sends one extra event,
`{"choices": [], "usage": {...}}`, that the client did not ask for; dropping that whole
event gives the client the stream it would have had without the proxy.

Events are cut only at blank lines, so the few bytes of an event that a network read split
wait for the rest of it; a client cannot use half an event anyway. Any event that is not
usage-only passes byte for byte.
"""

from __future__ import annotations

import re

from proxy.core.sse import DEFAULT_MAX_EVENT_BYTES

_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_MARKER = b'"usage"'


class UsageEventStripper:
    """Holds back at most `max_event_bytes` of an unfinished event. A larger event cannot
    be the small usage event the proxy asked for: what is held goes out at once, and the
    stripper steps aside for the rest of the stream (`gave_up`), so bytes keep flowing."""

    __slots__ = ("_parts", "_pending", "gave_up", "max_event_bytes")

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self.max_event_bytes = max_event_bytes
        self._parts: list[bytes] = []  # an unfinished event, in pieces (never re-copied)
        self._pending = 0
        self.gave_up = False

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to send to the client for this chunk (possibly empty)."""
        if self.gave_up:
            return chunk
        if self._parts:
            # An event end may straddle the previous piece and this chunk ("\n" | "\n").
            tail = b"".join(self._parts[-3:])[-3:]
            end = _last_event_end(tail + chunk) - len(tail)
            if end <= 0:
                return self._hold(chunk)
            self._parts.append(chunk[:end])
            data = b"".join(self._parts)
            self._parts, self._pending = [], 0
            rest = chunk[end:]
        else:
            end = _last_event_end(chunk)
            if end == 0:
                return self._hold(chunk)
            data, rest = (chunk, b"") if end == len(chunk) else (chunk[:end], chunk[end:])
        if rest:
            self._hold(rest)
        if _MARKER not in data:
            return data
        return b"".join(_without_usage(e) for e in _events(data))

    def _hold(self, piece: bytes) -> bytes:
        self._parts.append(piece)
        self._pending += len(piece)
        if self._pending <= self.max_event_bytes:
            return b""
        self.gave_up = True
        held, self._parts, self._pending = b"".join(self._parts), [], 0
        return held

    def flush(self) -> bytes:
        """End of stream: whatever is pending goes out unchanged."""
        rest = b"".join(self._parts)
        self._parts, self._pending = [], 0
        return _without_usage(rest)


def _without_usage(event: bytes) -> bytes:
    if not _is_usage_only(event):
        return event
    # Blank lines before the event are not part of it: they stay, wherever a read split them.
    return event[: len(event) - len(event.lstrip(b"\r\n"))]


def _events(data: bytes) -> list[bytes]:
    events, pos = [], 0
    for match in _EVENT_END.finditer(data):
        events.append(data[pos : match.end()])
        pos = match.end()
    if pos < len(data):
        # A stray line end after the last event ("\n\n\n"): not an event, but its bytes
        # are the client's all the same.
        events.append(data[pos:])
    return events


def _last_event_end(data: bytes) -> int:
    if b"\r" not in data:
        i = data.rfind(b"\n\n")
        return 0 if i < 0 else i + 2
    best = 0
    for match in _EVENT_END.finditer(data):
        best = match.end()
    return best


_CHOICES_EMPTY = re.compile(rb'"choices"\s*:\s*\[\s*\]')
# An object, not `"usage": null`: OpenAI and Azure put a null usage on every chunk once
# include_usage is set, and Azure's prompt-filter chunk also has empty choices.
_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')


def _is_usage_only(event: bytes) -> bool:
    return (
        _MARKER in event
        and _CHOICES_EMPTY.search(event) is not None
        and _USAGE_OBJECT.search(event) is not None
    )
