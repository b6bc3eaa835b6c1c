"""Removes the usage-only event that the proxy itself asked for, and nothing else.

When the client streamed without `stream_options.include_usage`, the proxy asks for usage
upstream so token counts come from the backend. The backend then sends one extra event,
`{"choices": [], "usage": {...}}`, that the client did not ask for; dropping that whole
event gives the client the stream it would have had without the proxy.

Asking can change more than that one event: a backend may move a member it writes on the
terminal chunk (the one whose choice has a `finish_reason`) onto the usage chunk when usage
is asked for. Where that is known, the stripper puts the member back where the backend
writes it direct, with the usage chunk's exact bytes (`MOVED`):

- vLLM stamps `"system_fingerprint"` on the terminal chunk only when no usage chunk
  follows; with `include_usage` it writes it on the usage chunk instead
  (vllm-project/vllm, vLLM 0.32: vllm/entrypoints/openai/chat_completion/serving.py and
  completion/serving.py, the stream generators: `if not include_usage and
  self.system_fingerprint is not None and finish_reason is not None:
  chunk.system_fingerprint = ...`, and the final usage chunk built with
  `system_fingerprint=self.system_fingerprint`); direct, it is the terminal chunk's last
  member (compact JSON, the field after `choices` when no `usage` is set).
- llama.cpp writes its `"timings"` object on the last chunk of the final result
  (`deltas.back()["timings"] = stats.to_json()` in
  `server_task_result_cmpl_final::to_json_oaicompat_chat_stream`,
  tools/server/server-task.cpp, llama.cpp as vendored in llama-cpp-python 0.3.36): the
  finish chunk direct, the usage chunk (`if (include_usage) deltas.push_back(...)`) when
  usage is asked; it is the last member either way (nlohmann::ordered_json, insertion order).

A member of the usage chunk that the terminal chunk also has (`id`, `model`,
llama.cpp's `system_fingerprint`) was not moved; one that belongs to usage alone (`usage`;
vLLM's per-request `metrics`, which it writes only on the usage chunk: proxy/core/engine.py)
goes with it (`USAGE_ONLY`). Any other member is one the stripper cannot place: it is
dropped with the usage chunk, the stripper says so (`unplaced`), and the `Injection` it
was given stops the proxy asking that upstream for usage from then on
(proxy/server/admission.py), so later streams are the backend's own, byte for byte. The
terminal chunk waits for the next event only while it might be followed by the usage
chunk; a usage chunk the member scan cannot read (not one JSON object) is dropped as
before and counts as unplaced. With n > 1 a backend may stamp every choice's terminal
chunk, and only the last one comes right before the usage chunk: the proxy does not ask
for usage then (proxy/core/apis/chat.py).

A backend that writes usage on events with choices, which the proxy never asks for
(`continuous_usage_stats` goes out false: proxy/core/apis/chat.py), writes it whatever the
request says: vLLM with `--enable-force-include-usage` (vLLM 0.32:
vllm/entrypoints/serve/utils/api_utils.py, should_include_usage: `if
enable_force_include_usage: return True, True`, usage then on every chunk from the role
chunk on, and the usage chunk at the end). Its client gets the usage chunk direct too, so
the stripper steps aside for the rest of the stream (`stepped_aside`), and the `Injection`
stops asking that upstream for usage on that API (`forced`): its usage comes unasked.
llama.cpp does so on /v1/completions alone, where the finish chunk carries `usage` asked
or not (tools/server/server-task.cpp, to_json_oaicompat), and its chat is still asked. A
backend that reshapes its chunks only because usage was asked is stepped aside from the
same way, after its first stream: Ollama's /v1/completions writes an all-zero usage on
each (middleware/openai.go), and OpenAI and Azure a `"usage": null` on every chunk once
include_usage is set (openai-python, `ChatCompletionStreamOptionsParam.include_usage`:
"All other chunks will also include a `usage` field, but with a null value").

Events are cut only at blank lines, so the few bytes of an event that a network read split
wait for the rest of it; a client cannot use half an event anyway. Any other event passes
byte for byte. An event of comment lines alone (`: ping`, which a gateway may write
anywhere) stays where it is and does not part a terminal chunk from the usage chunk.
What is held when the stream ends goes out then: at a clean end (`flush`), and when the
stream breaks off (`at_break`, which keeps back half an event that may be the usage chunk).

A compressed body (a backend or gateway that ignores the proxy's `Accept-Encoding:
identity`) cannot be read, so the usage chunk the proxy asked for reaches the client:
the stripper steps aside and the `Injection` stops asking that upstream (`encoded`), so
it happens once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from proxy.core.sse import DEFAULT_MAX_EVENT_BYTES

_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_MARKER = b'"usage"'
_FINISHED = b'"finish_reason":"'  # a terminal chunk, as vLLM and llama.cpp write it (compact)

#: Members a backend moves from the terminal chunk to the usage chunk when usage is asked
#: for, and where each comes from (the module's docstring). Direct, each is the terminal
#: chunk's last member; several go back in the usage chunk's order.
MOVED = {
    "system_fingerprint": "vLLM 0.32: chat_completion/serving.py, completion/serving.py",
    "timings": "llama.cpp: tools/server/server-task.cpp, to_json_oaicompat_chat_stream",
}
#: Members of the usage chunk that go with it: direct, the client has them nowhere.
USAGE_ONLY = frozenset({"usage", "metrics"})


class Injection:
    """Whether the proxy still asks this upstream for usage it strips again: one per
    upstream, shared by every request. `refuse` turns it off for good when a stripper met a
    usage chunk whose members it could not all place, and tells `on_refuse` (the metric and
    the log line) once."""

    __slots__ = ("on", "on_forced", "on_leaked", "on_refuse", "unasked", "unplaced")

    def __init__(self, on_refuse: Callable[[tuple[str, ...]], None] | None = None) -> None:
        self.on = True
        self.unplaced: tuple[str, ...] = ()
        self.on_refuse = on_refuse
        self.unasked: set[str] = set()  # the APIs (endpoints) whose usage comes unasked
        self.on_forced: Callable[[str], None] | None = None
        self.on_leaked: Callable[[str], None] | None = None

    def asks(self, endpoint: str) -> bool:
        """Whether to ask this upstream for usage on this API."""
        return self.on and endpoint not in self.unasked

    def forced(self, endpoint: str) -> None:
        """The upstream streams usage unasked on this API: asking is needless there, and
        stripping wrong."""
        if endpoint in self.unasked:
            return
        self.unasked.add(endpoint)
        if self.on_forced is not None:
            self.on_forced(endpoint)

    def refuse(self, unplaced: tuple[str, ...]) -> None:
        if not self.on:
            return
        self.on, self.unplaced = False, unplaced
        if self.on_refuse is not None:
            self.on_refuse(unplaced)

    def leaked(self, how: str) -> None:
        """A stream the proxy asked usage of came in a form no stripper can read (`how`:
        compressed though the proxy asked for `identity`, or an event stream under
        another Content-Type, whose head went out before its body told), so the usage
        chunk reached the client. Asking stops for good, so that happens once, and
        `on_leaked` (the metric and the log line) is told once."""
        if not self.on:
            return
        self.on = False
        if self.on_leaked is not None:
            self.on_leaked(how)


class UsageEventStripper:
    """Holds back at most `max_event_bytes` of an unfinished event. A larger event cannot
    be the small usage event the proxy asked for: what is held goes out at once, and the
    stripper steps aside for the rest of the stream (`gave_up`), so bytes keep flowing.
    `unplaced` names the usage chunk's members that it could not put back."""

    __slots__ = (
        "_endpoint",
        "_injection",
        "_parts",
        "_pending",
        "_terminal",
        "gave_up",
        "max_event_bytes",
        "stepped_aside",
        "unplaced",
    )

    def __init__(
        self,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
        injection: Injection | None = None,
        endpoint: str = "",
    ) -> None:
        self.max_event_bytes = max_event_bytes
        self._injection = injection
        self._endpoint = endpoint  # the API whose stream this is (Injection.forced)
        self._parts: list[bytes] = []  # an unfinished event, in pieces (never re-copied)
        self._pending = 0
        self._terminal = b""  # a whole terminal chunk waiting for the next event
        self.gave_up = False
        self.stepped_aside = False  # the upstream streams usage unasked (the module's doc)
        self.unplaced: tuple[str, ...] = ()

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
            if self.gave_up:  # stepped aside: the start of the next event goes too
                return data + rest
        if rest:  # the start of the next event; all of it at once if too large to wait
            data += self._hold(rest)
        return data

    def _rewrite(self, data: bytes, hold: bool) -> bytes:
        """Whole events without the usage-only one; a terminal chunk that the usage chunk
        follows gets back what the backend moved; with `hold`, a terminal chunk last in
        `data` waits in `_terminal` for the next event. Usage beside choices: all of `data`
        as it is, and the stripper steps aside (the module's doc)."""
        if _MARKER in data and any(_usage_beside_choices(e) for e in _events(data)):
            self.gave_up = self.stepped_aside = True
            if self._injection is not None:
                self._injection.forced(self._endpoint)
            return data
        out: list[bytes] = []
        terminal = -1  # where in `out` the last terminal chunk is, if no event came after it
        for event in _events(data):
            if _is_usage_only(event):
                if terminal >= 0:
                    out[terminal] = self._restored(out[terminal], event)
                terminal = -1
                event = _leading_blank_lines(event)
            elif _FINISHED in event:
                terminal = len(out)
            elif event.strip(b"\r\n") and not _comments_only(event):
                terminal = -1
            out.append(event)
        if hold and terminal >= 0:
            self._terminal = b"".join(out[terminal:])
            del out[terminal:]
        return b"".join(out)

    def _restored(self, terminal: bytes, usage: bytes) -> bytes:
        """`terminal` with the members the backend moved onto `usage` back as its last ones;
        the usage chunk's members that are neither moved nor its own go to `unplaced`."""
        theirs, ours = _members(usage), _members(terminal)
        if theirs is None or ours is None:
            self._unplaced(("(unreadable usage chunk)",))
            return terminal
        moved: list[str] = []
        unplaced: list[str] = []
        for name, raw in theirs.items():
            if name in ours or name in USAGE_ONLY:
                continue
            if name in MOVED:
                moved.append(raw if raw.lstrip().startswith(",") else "," + raw)
            else:
                unplaced.append(name[:40])
        if unplaced:
            self._unplaced(tuple(unplaced[:8]))
        if not moved:
            return terminal
        end = terminal.rfind(b"}")
        return terminal[:end] + "".join(moved).encode() + terminal[end:]

    def encoded(self) -> None:
        """The body comes compressed (Content-Encoding): the stripper cannot read it, so
        it steps aside, and its `Injection` stops asking (`Injection.leaked`)."""
        self.gave_up = True
        if self._injection is not None:
            self._injection.leaked("compressed it though the proxy asked for identity")

    def _unplaced(self, names: tuple[str, ...]) -> None:
        self.unplaced = names
        if self._injection is not None:
            self._injection.refuse(names)

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

    def withholds(self) -> bool:
        """Whether a whole event waits here that the client has not been given: a
        terminal chunk held for the usage chunk after it (what `at_break` hands over
        first)."""
        return bool(self._terminal)

    def at_break(self) -> bytes:
        """The stream broke off before its end (the upstream broke or went silent, the
        drain's end): what is held, for the client to get before its connection drops,
        as it would have direct. A terminal chunk waiting for the next event is whole
        and the client's: it goes as it is (what a backend moved onto the usage chunk
        that never came stays missing). An unfinished event goes too, byte for byte,
        unless it may be the start of the usage chunk the proxy asked for: one begun
        right after a terminal chunk, where a backend writes that chunk (vLLM and
        llama.cpp: before `[DONE]`), or one whose bytes so far show empty choices or a
        usage object. The stripper cannot tell what such half an event would have been;
        held back, it costs the client nothing it could read (an SSE client drops an
        unfinished event at the end of the stream), while sent, it would show the
        client part of an event it never asked for. Its leading line ends still go."""
        terminal, partial = self._terminal, b"".join(self._parts)
        self._parts, self._pending, self._terminal = [], 0, b""
        if partial and (terminal or _may_be_usage(partial)):
            partial = _leading_blank_lines(partial)
        return terminal + partial


def _leading_blank_lines(event: bytes) -> bytes:
    # Blank lines before the event are not part of it: they stay, wherever a read split them.
    return event[: len(event) - len(event.lstrip(b"\r\n"))]


_DECODER = json.JSONDecoder()
_SPACE = " \t\r\n"


def _members(event: bytes) -> dict[str, str] | None:
    """The top-level members of the one JSON object an event carries, by name, each as its
    exact text from the end of the member before it (so with its comma) to the end of its
    value: `,"timings":{...}`. None when the event holds no single object (one `data:`
    line). Run once per stream, on the terminal and the usage chunk only."""
    start, end = event.find(b"{"), event.rfind(b"}")
    if start < 0 or end < start:
        return None
    try:
        text = event[start : end + 1].decode()
        members: dict[str, str] = {}
        pos = before = 1
        while True:
            while text[pos] in _SPACE:
                pos += 1
            if text[pos] == "}" and not members:
                break
            if text[pos] != '"':
                return None
            name, pos = json.decoder.scanstring(text, pos + 1)  # type: ignore[attr-defined]
            while text[pos] in _SPACE:
                pos += 1
            if text[pos] != ":":
                return None
            pos += 1
            while text[pos] in _SPACE:
                pos += 1
            _, pos = _DECODER.raw_decode(text, pos)
            members[name] = text[before:pos]
            before = pos
            while text[pos] in _SPACE:
                pos += 1
            if text[pos] == "}":
                break
            if text[pos] != ",":
                return None
            pos += 1
    except (ValueError, IndexError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    return members if pos == len(text) - 1 else None


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
# The usage chunk's usage is an object, never `"usage": null`: Azure's prompt-filter chunk
# also has empty choices, with the null usage OpenAI and Azure put on every chunk once
# include_usage is set.
_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')
# Beside choices, a null usage is a reshaped chunk too (the module's doc).
_USAGE_MEMBER = re.compile(rb'"usage"\s*:\s*[{n]')


def _usage_beside_choices(event: bytes) -> bool:
    """A usage member, an object or null, on an event whose choices are not empty (not the
    usage-only one)."""
    return (
        _USAGE_MEMBER.search(event) is not None
        and b'"choices"' in event
        and _CHOICES_EMPTY.search(event) is None
    )


def _comments_only(event: bytes) -> bool:
    """An event of SSE comment lines (`:` first) and line ends alone."""
    return all(not line or line.startswith(b":") for line in event.splitlines())


def _may_be_usage(partial: bytes) -> bool:
    """Whether an unfinished event's bytes so far could be the usage-only event's."""
    return _CHOICES_EMPTY.search(partial) is not None or _USAGE_OBJECT.search(partial) is not None


def _is_usage_only(event: bytes) -> bool:
    return (
        _MARKER in event
        and _CHOICES_EMPTY.search(event) is not None
        and _USAGE_OBJECT.search(event) is not None
    )
