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

_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_MARKER = b'"usage"'


class UsageEventStripper:
    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to send to the client for this chunk (possibly empty)."""
        data = self._pending + chunk if self._pending else chunk
        end = _last_event_end(data)
        self._pending = data[end:]
        complete = data if end == len(data) else data[:end]
        if _MARKER not in complete:
            return complete
        return b"".join(_without_usage(e) for e in _events(complete))

    def flush(self) -> bytes:
        """End of stream: whatever is pending goes out unchanged."""
        rest, self._pending = self._pending, b""
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
