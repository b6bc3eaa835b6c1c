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


class SSEDecoder:
    __slots__ = ("_buf", "_data", "_skip_lf")

    def __init__(self) -> None:
        self._buf = b""  # an incomplete line carried to the next feed
        self._data: list[bytes] = []  # data lines of the event being built
        self._skip_lf = False  # the previous feed ended in CR: a leading LF completes a CRLF

    def feed(self, chunk: bytes) -> list[bytes]:
        """Decode `chunk`; return the data payloads of the events it completed."""
        if not chunk:  # an empty read must not forget a pending CR
            return []
        if self._skip_lf:
            self._skip_lf = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        data = self._buf + chunk if self._buf else chunk
        if b"\r" in data:
            lines = _LINE_END.split(data)
            # A trailing CR ends its line now; an LF in the next chunk belongs to it.
            self._skip_lf = data.endswith(b"\r")
        else:
            lines = data.split(b"\n")
        self._buf = lines.pop()
        events: list[bytes] = []
        for line in lines:
            self._line(line, events)
        return events

    def flush(self) -> list[bytes]:
        """End of stream: dispatch what is pending, as if a blank line had arrived."""
        events: list[bytes] = []
        if self._buf:
            self._line(self._buf, events)
            self._buf = b""
        self._line(b"", events)
        return events

    def _line(self, line: bytes, events: list[bytes]) -> None:
        if not line:
            if self._data:
                events.append(self._data[0] if len(self._data) == 1 else b"\n".join(self._data))
                self._data = []
            return
        if line.startswith(b"data:"):
            value = line[5:]
            self._data.append(value[1:] if value[:1] == b" " else value)
        elif line == b"data":  # a field with no colon has an empty value
            self._data.append(b"")
        # comments (":...") and other fields are ignored
