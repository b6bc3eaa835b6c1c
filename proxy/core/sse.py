"""An I/O-free incremental Server-Sent Events decoder: bytes in, `data` payloads out.

Follows the WHATWG event-stream rules that matter for OpenAI-compatible streams:
lines end at CRLF, LF or CR (on bytes, never `str.splitlines`, which also splits at
U+2028 inside JSON); a blank line dispatches the event; `data:` lines of one event are
joined with LF; one space after the colon is dropped (`data:x` and `data: x` are the same);
lines starting with `:` are comments (keep-alives); other fields (`event`, `id`, `retry`)
do not matter to an OpenAI stream and are skipped.

One deliberate leniency: `flush()` at end of stream dispatches an event that lacked its
blank line, because a measuring proxy would rather see a backend's last event than not.
"""

from __future__ import annotations

import re

_LINE_END = re.compile(rb"\r\n|\r|\n")

#: Default for --max-event-bytes: far above any real chat chunk, far below what hurts.
DEFAULT_MAX_EVENT_BYTES = 4 * 1024 * 1024


class EventTooLarge(ValueError):
    """An event (or one line of it) grew past the decoder's limit: the stream cannot be
    measured without holding an unbounded amount of it."""


class SSEDecoder:
    """Holds at most `max_event_bytes` of an incomplete event, and copies each byte a
    bounded number of times: pieces of an unfinished line are kept as a list and joined
    once, when the line ends, never re-copied on every read."""

    __slots__ = ("_data", "_data_bytes", "_parts", "_pending", "_skip_lf", "max_event_bytes")

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self.max_event_bytes = max_event_bytes
        self._parts: list[bytes] = []  # pieces of an incomplete line carried to later feeds
        self._pending = 0  # their total size
        self._data: list[bytes] = []  # data lines of the event being built
        self._data_bytes = 0
        self._skip_lf = False  # the previous feed ended in CR: a leading LF completes a CRLF

    def feed(self, chunk: bytes) -> list[bytes]:
        """Decode `chunk`; return the data payloads of the events it completed.

        Raises EventTooLarge when the event being built passes `max_event_bytes`."""
        if not chunk:  # an empty read must not forget a pending CR
            return []
        if (  # the common read: one whole `data: ...` event, nothing pending, LF line ends
            chunk.startswith(b"data: ")
            and chunk.endswith(b"\n\n")
            and not (self._parts or self._data or self._skip_lf)
            and chunk.find(b"\n", 6) == len(chunk) - 2
            and b"\r" not in chunk
            and len(chunk) - 2 <= self.max_event_bytes
        ):
            return [chunk[6:-2]]
        if self._skip_lf:
            self._skip_lf = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
                if not chunk:
                    return []
        end = max(chunk.rfind(b"\n"), chunk.rfind(b"\r")) + 1
        if end == 0:  # no line ends here: keep the piece, copy nothing
            self._parts.append(chunk)
            self._pending += len(chunk)
            if self._pending + self._data_bytes > self.max_event_bytes:
                raise EventTooLarge(f"an event over {self.max_event_bytes} bytes")
            return []
        if self._parts:
            self._parts.append(chunk[:end])
            data = b"".join(self._parts)
            self._parts = []
        else:
            data = chunk if end == len(chunk) else chunk[:end]
        if end < len(chunk):
            self._parts.append(chunk[end:])
            self._pending = len(chunk) - end
        else:
            self._pending = 0
            # A trailing CR ends its line now; an LF in the next chunk belongs to it.
            self._skip_lf = chunk[-1:] == b"\r"
        lines = _LINE_END.split(data) if b"\r" in data else data.split(b"\n")
        lines.pop()  # data ends with a line end: the last piece is empty
        events: list[bytes] = []
        for line in lines:
            self._line(line, events)
        if self._pending + self._data_bytes > self.max_event_bytes:
            raise EventTooLarge(f"an event over {self.max_event_bytes} bytes")
        return events

    def flush(self) -> list[bytes]:
        """End of stream: dispatch what is pending, as if a blank line had arrived."""
        events: list[bytes] = []
        if self._parts:
            self._line(b"".join(self._parts), events)
            self._parts, self._pending = [], 0
        self._line(b"", events)
        return events

    def _line(self, line: bytes, events: list[bytes]) -> None:
        if not line:
            if self._data:
                events.append(self._data[0] if len(self._data) == 1 else b"\n".join(self._data))
                self._data = []
                self._data_bytes = 0
            return
        if line.startswith(b"data:"):
            value = line[5:]
            self._data.append(value[1:] if value[:1] == b" " else value)
            self._data_bytes += len(line)
            if self._data_bytes > self.max_event_bytes:
                raise EventTooLarge(f"an event over {self.max_event_bytes} bytes")
        elif line == b"data":  # a field with no colon has an empty value
            self._data.append(b"")
        # comments (":...") and other fields are ignored
