"""An I/O-free incremental newline-delimited JSON decoder: bytes in, lines out.

Ollama's native API streams `application/x-ndjson`: one JSON object a line, each written
by Go's `json.Marshal` plus `'\\n'` (ollama/ollama server/routes.go streamResponse,
"Delineate chunks with new-line delimiter"), or by `json.Encoder.Encode` for an error
line, which also ends in `'\\n'`. So a line ends at LF only, and a CR before it is dropped
(as Go's bufio.ScanLines does when Ollama's own client reads the stream). Splitting is
done on bytes, never with `str.splitlines`, which also splits at U+2028 inside JSON.
Blank lines carry nothing and are skipped.

The decoder has the SSE decoder's interface (proxy/core/sse.py): `feed(chunk)` returns
the lines the chunk completed, `flush()` at the end of the body returns a last line that
lacked its LF (a measuring proxy would rather see a backend's last line than not).
"""

from __future__ import annotations

from proxy.core.sse import DEFAULT_MAX_EVENT_BYTES, EventTooLarge


class NDJSONDecoder:
    """Holds at most `max_event_bytes` of an unfinished line; pieces of it are kept as a
    list and joined once, when the line ends."""

    __slots__ = ("_parts", "_pending", "max_event_bytes")

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self.max_event_bytes = max_event_bytes
        self._parts: list[bytes] = []  # pieces of the unfinished line
        self._pending = 0  # their total size

    def feed(self, chunk: bytes) -> list[bytes]:
        """Decode `chunk`; return the complete non-blank lines it ended, without their
        line ends. Raises EventTooLarge when a line grows past `max_event_bytes`."""
        end = chunk.rfind(b"\n") + 1
        if end == 0:  # no line ends here: keep the piece
            if chunk:
                self._parts.append(chunk)
                self._pending += len(chunk)
                if self._pending > self.max_event_bytes:
                    raise EventTooLarge(f"a line over {self.max_event_bytes} bytes")
            return []
        if self._parts:
            self._parts.append(chunk[:end])
            data = b"".join(self._parts)
            self._parts = []
        elif end == len(chunk) and chunk.find(b"\n") == end - 1:  # the common read: one line
            line = chunk[:-2] if chunk[-2:] == b"\r\n" else chunk[:-1]
            self._pending = 0
            self._check(line)
            return [line] if line.strip() else []
        else:
            data = chunk if end == len(chunk) else chunk[:end]
        rest = len(chunk) - end
        if rest:
            self._parts.append(chunk[end:])
        self._pending = rest
        lines: list[bytes] = []
        for line in data.split(b"\n")[:-1]:
            if line[-1:] == b"\r":
                line = line[:-1]
            self._check(line)
            if line.strip():
                lines.append(line)
        if self._pending > self.max_event_bytes:
            raise EventTooLarge(f"a line over {self.max_event_bytes} bytes")
        return lines

    def flush(self) -> list[bytes]:
        """End of body: the last line, if it lacked its LF."""
        if not self._parts:
            return []
        line = b"".join(self._parts)
        self._parts, self._pending = [], 0
        if line[-1:] == b"\r":
            line = line[:-1]
        return [line] if line.strip() else []

    def _check(self, line: bytes) -> None:
        if len(line) > self.max_event_bytes:
            raise EventTooLarge(f"a line over {self.max_event_bytes} bytes")
