"""Removes the usage-only event that the proxy itself asked for, and nothing else.

When the client streamed without `stream_options.include_usage`, the proxy asks for usage
upstream so token counts come from the backend. The backend then sends one extra event,
`{"choices": [], "usage": {...}}`, that the client did not ask for; dropping that whole
event gives the client the stream it would have had without the proxy.

Asking changes one more thing, which the stripper puts back. vLLM stamps
`"system_fingerprint"` on a stream's terminal chunk (the one whose choice has a
`finish_reason`) only when no usage chunk follows; with `include_usage` it writes it on the
usage chunk instead (vllm-project/vllm, vLLM 0.32:
vllm/entrypoints/openai/chat_completion/serving.py and completion/serving.py, the stream
generators: `if not include_usage and self.system_fingerprint is not None and
finish_reason is not None: chunk.system_fingerprint = ...`, and the final usage chunk
built with `system_fingerprint=self.system_fingerprint`). So a terminal chunk without a
fingerprint waits for the next event: if that is the usage chunk the proxy asked for, the
terminal chunk goes out with the usage chunk's `,"system_fingerprint":"..."` as its last
member, which is where vLLM's serialisation puts it (compact JSON, the field after
`choices` when no `usage` is set), byte for byte as the client would have had it direct
(tests/fixtures/streams/vllm-0.32/). With n > 1 vLLM stamps every choice's terminal
chunk, and only the last one comes right before the usage chunk: the proxy does not ask
for usage then (proxy/core/apis/chat.py).

Events are cut only at blank lines, so the few bytes of an event that a network read split
wait for the rest of it; a client cannot use half an event anyway. Any other event passes
byte for byte.
"""

from __future__ import annotations

import re

from proxy.core.sse import DEFAULT_MAX_EVENT_BYTES

_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_MARKER = b'"usage"'
_FINISHED = b'"finish_reason":"'  # a terminal chunk, as vLLM writes it (compact JSON)
_STAMP = b'"system_fingerprint"'
_FINGERPRINT = re.compile(rb'"system_fingerprint":("(?:[^"\\]|\\.)*")')


class UsageEventStripper:
    """Holds back at most `max_event_bytes` of an unfinished event. A larger event cannot
    be the small usage event the proxy asked for: what is held goes out at once, and the
    stripper steps aside for the rest of the stream (`gave_up`), so bytes keep flowing."""

    __slots__ = ("_parts", "_pending", "_terminal", "gave_up", "max_event_bytes")

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self.max_event_bytes = max_event_bytes
        self._parts: list[bytes] = []  # an unfinished event, in pieces (never re-copied)
        self._pending = 0
        self._terminal = b""  # a whole terminal chunk waiting for the next event
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
        if self._terminal:  # once per stream: the terminal chunk and what follows it
            data, self._terminal = self._terminal + data, b""
        if _MARKER in data or _FINISHED in data:
            data = self._rewrite(data, hold=True)
        if rest:  # the start of the next event; all of it at once if too large to wait
            data += self._hold(rest)
        return data

    def _rewrite(self, data: bytes, hold: bool) -> bytes:
        """Whole events without the usage-only one; a terminal chunk that the usage chunk
        follows gets its fingerprint back; with `hold`, a terminal chunk last in `data`
        waits in `_terminal` for the next event."""
        out: list[bytes] = []
        terminal = -1  # where in `out` a terminal chunk without a fingerprint is, if last
        for event in _events(data):
            if _is_usage_only(event):
                found = _FINGERPRINT.search(event) if terminal >= 0 else None
                if found is not None:
                    out[terminal] = _stamped(out[terminal], found.group(1))
                terminal = -1
                event = _leading_blank_lines(event)
            elif _FINISHED in event and _STAMP not in event:
                terminal = len(out)
            elif event.strip(b"\r\n"):
                terminal = -1
            out.append(event)
        if hold and terminal >= 0:
            self._terminal = b"".join(out[terminal:])
            del out[terminal:]
        return b"".join(out)

    def _hold(self, piece: bytes) -> bytes:
        self._parts.append(piece)
        self._pending += len(piece)
        if self._pending <= self.max_event_bytes:
            return b""
        self.gave_up = True
        held, self._parts, self._pending = b"".join(self._parts), [], 0
        held, self._terminal = self._terminal + held, b""
        return held

    def flush(self) -> bytes:
        """End of stream: whatever is pending goes out, less a usage-only event."""
        rest = self._terminal + b"".join(self._parts)
        self._parts, self._pending, self._terminal = [], 0, b""
        return self._rewrite(rest, hold=False) if rest else rest


def _leading_blank_lines(event: bytes) -> bytes:
    # Blank lines before the event are not part of it: they stay, wherever a read split them.
    return event[: len(event) - len(event.lstrip(b"\r\n"))]


def _stamped(event: bytes, fingerprint: bytes) -> bytes:
    """The terminal chunk as vLLM writes it without include_usage: the fingerprint is the
    object's last member."""
    end = event.rfind(b"}")
    return event[:end] + b',"system_fingerprint":' + fingerprint + event[end:]


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
