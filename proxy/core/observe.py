"""Watches the bytes of one response on the side and turns them into a Measurement.

The relay calls `feed(chunk, now)` after each chunk has gone to the client, with `now` the
time of that network read, so this module never reads a clock and tests can replay
recorded streams with synthetic timestamps. It knows no API: each event goes to the
request's `Api` (proxy/core/apis/), which answers with `Facts` (content or not, finish
reason, usage, in-stream error, clean end); non-streaming bodies are kept and handed to the
Api once at the end, whole up to MAX_KEPT_BODY, else from their two ends
(proxy/core/json_ends.py). A stream asked for that comes under another label
(some gateways say application/json) is one when its first bytes open an event stream
(`_sniff`). A stream's repeating content event is recognised
from its bytes once one has been parsed and proven (proxy/core/template.py). `finish()`
is the one sequence that turns what was seen into the record: outcome, then token
counts from usage, else a tokenizer, else content events.

With n > 1 choices, first/last token and content events are kept per choice (see
proxy/core/measurement.py for how the request-level TPOT and decode speed are chosen).

Content kinds (issue 26). Each content event's kind ("text", "reasoning", "tool") gives
the first answer, the reasoning span and the first tool call. The inline path counts a run
of one shared content answer (`_fast`: the same kind, choice 0, nothing else) without
looking at its kind, as before; a run is accounted for when an event of another shape
arrives and at the end (`_end_run`), so a plain text stream does no new work per chunk.
When the kind changes, the stream's template is learnt once more for the new kind. An
answer event that also carries reasoning (Facts.reasoning: the closing tag fell inside one
delta) is one reasoning event and the first answer, at the same instant.
Tool-call events carry their pieces (Facts.calls) and are followed by a ToolCalls
(proxy/core/toolcalls.py), made only when a stream carries one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

import orjson

from proxy.core.apis import Api, Facts, RequestInfo, TokenCounts, api_of
from proxy.core.engine import EngineMetrics
from proxy.core.errors import classify_response, classify_stream_end, error_message
from proxy.core.fingerprint import prefix_of
from proxy.core.json_ends import BodyEnds
from proxy.core.llamacpp import several_prompts, timings_metrics
from proxy.core.measurement import NONE_LABEL, ErrorType, Measurement, TokenSource
from proxy.core.sse import DEFAULT_MAX_EVENT_BYTES
from proxy.core.template import EventTemplate, learn
from proxy.core.toolcalls import ToolCall, ToolCalls, is_json_object

#: The most of a non-streaming or error body kept whole for parsing. A larger one is still
#: relayed in full; only its two ends are kept, and its record is read from them
#: (proxy/core/json_ends.py): an answer in flight holds 1 MiB at most, not all it is, and
#: reading it at its end holds the event loop about 1 ms for a megabyte whole, 2 ms for a
#: larger one's ends (parsing 8 MiB whole took 20). What lies in a larger one's middle is
#: not read: its texts, reasoning and tool calls, as a streamed call's arguments are not
#: kept past 1 MiB either (proxy/core/toolcalls.py MAX_ARGUMENT_BYTES).
MAX_KEPT_BODY = 1024 * 1024

#: The token sources whose output count includes the token that ended a choice (the EOS,
#: which has no text): the backend's own counts (`StreamObserver._ending_reads`).
COUNTS_THE_ENDING_TOKEN = frozenset((TokenSource.USAGE, TokenSource.ENGINE, TokenSource.TOKEN_IDS))

#: The token sources that count only what streamed (the chunks, a tokenizer's count of the
#: texts): a token a parser held back reached the client as nothing, and is not in them
#: (`StreamObserver._held_uncounted`).
COUNTS_WHAT_STREAMED = frozenset((TokenSource.CHUNKS, TokenSource.TOKENIZER))


#: How often one stream's template is learnt again when its content kind changes.
RELEARNS = 4

#: The bytes of one character a detokenizer may still hold back where a text ends: up to 3
#: of a 4-byte UTF-8 character, each byte a token of a byte-level BPE, counted with no text
#: (vLLM's DecodeStream step gives no text until the character is whole,
#: v1/engine/detokenizer.py `_protected_step`, and a finished request's text is what it
#: gave). Bytes it could not complete before more text come out as U+FFFD, 3 bytes.
HELD_BYTES = 3

#: The most tokens a choice's body of reasoning alone spends on anything else: a generated
#: `<think>`, a `</think>` with nothing after it (vLLM's extract_reasoning then gives null
#: content, vllm/reasoning/basic_parsers.py) and the EOS. Usage below the output less these
#: contradicts the body (`StreamObserver.reasoning`).
WHOLE_NOT_REASONING = 3

#: How an event stream's body may open: a `data:` or `event:` field (Messages' and
#: Responses' streams open with `event:`), or a comment, as vLLM's keep-alive (`: keep-alive`,
#: --sse-keep-alive-interval: vllm/entrypoints/serve/utils/sse_keep_alive.py). No JSON
#: document begins with any of them.
SSE_OPENINGS = (b"data:", b"event:", b":")
_LONGEST_OPENING = max(len(opening) for opening in SSE_OPENINGS)

#: Outcomes whose tokens a tokenizer counts: successes, and requests whose client walked
#: away (no usage arrives; their prompt and partial output are compute nobody received).
_COUNTED = frozenset({None, ErrorType.CLIENT_CANCELLED})


class Counter(Protocol):
    """A tokenizer-backed counter (proxy/core/tokens.py), as `finish` uses it."""

    async def count(self, observer: StreamObserver) -> TokenCounts | None: ...

    async def count_reasoning(self, observer: StreamObserver) -> int | None: ...


class Collected:
    """Generated texts, collected for a tokenizer to count: `texts`, every one in the order
    it came, and `by_choice()`, each choice's own (with n > 1 vLLM counts each choice's
    tokens alone and adds them up). One store serves both: each text's choice is noted
    only once a second choice has come, so a one-choice answer (the usual) keeps its texts
    once and nothing beside them."""

    __slots__ = ("_choice", "_choices", "texts")

    def __init__(self) -> None:
        self.texts: list[str] = []
        self._choice = 0  # the choice of every text so far, while there is one
        self._choices: list[int] | None = None  # each text's choice, once there are several

    def add(self, texts: list[str], choice: int) -> None:
        if not texts:
            return
        choices = self._choices
        if choices is None:
            if not self.texts:
                self._choice = choice
            elif choice != self._choice:
                choices = self._choices = [self._choice] * len(self.texts)
        if choices is not None:
            choices.extend([choice] * len(texts))
        self.texts.extend(texts)

    def by_choice(self) -> list[tuple[int, list[str]]]:
        """(choice index, its texts in order), by choice index."""
        choices = self._choices
        if choices is None:
            return [(self._choice, self.texts)] if self.texts else []
        kept: dict[int, list[str]] = {}
        for text, choice in zip(self.texts, choices, strict=True):
            own = kept.get(choice)
            if own is None:
                kept[choice] = [text]
            else:
                own.append(text)
        return sorted(kept.items())


class _Choice:
    """One choice's content events and span, and its reasoning and answer phases' (with
    n > 1 each phase's time per token is per choice, as `tpot` is)."""

    __slots__ = ("answer", "events", "first", "last", "reasoning")

    def __init__(self, now: float) -> None:
        self.first = now
        self.last = now
        self.events = 1
        self.reasoning: _Phase | None = None
        self.answer: _Phase | None = None

    def phase(self, kind: str, now: float) -> None:
        """One event of `kind` ("reasoning" or "text") at `now`."""
        if kind == "reasoning":
            if self.reasoning is None:
                self.reasoning = _Phase(now)
            else:
                self.reasoning.add(1, now)
        elif kind == "text":
            if self.answer is None:
                self.answer = _Phase(now)
            else:
                self.answer.add(1, now)


class _Phase:
    """A choice's events of one kind: how many, the first's instant and the last's."""

    __slots__ = ("events", "first", "last")

    def __init__(self, now: float) -> None:
        self.first = now
        self.last = now
        self.events = 1

    def add(self, events: int, now: float) -> None:
        self.events += events
        self.last = now


def _engine_counts(engine: EngineMetrics) -> TokenCounts | None:
    """The counts of an engine's own account: llama.cpp's prompt is prompt_n + cache_n."""
    if engine.output_tokens is None:
        return None
    prompt = engine.prompt_tokens
    if prompt is not None and engine.cached_tokens is not None:
        prompt += engine.cached_tokens
    return TokenCounts(prompt, engine.output_tokens, engine.cached_tokens, TokenSource.ENGINE)


def _timings_counts(facts: Facts) -> TokenCounts | None:
    """One llama.cpp task's counts from its own timings."""
    engine = timings_metrics(facts.timings) if facts.timings is not None else None
    return None if engine is None else _engine_counts(engine)


class StreamObserver:
    """One per measured request. Not thread-safe; lives on the event loop."""

    def __init__(
        self,
        request: RequestInfo,
        start: float,
        collect_text: bool = False,
        api: Api | None = None,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
    ) -> None:
        self.request = request
        self.api = api if api is not None else api_of(request.endpoint)
        self.start = start
        self._collect = collect_text
        self.status = 0
        self.streaming = False
        self.binary = False
        self.metadata: bytes | None = None  # a binary answer's own JSON account (its header)
        self.failed = False  # measuring broke mid-stream: the record keeps only what is safe
        self.first_byte: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.itl: list[float] = []
        self.content_events = 0
        # engine outputs that streamed no content (Facts.held): output, no token instant
        self.held_events = 0
        self.held_finishes: dict[int, float] = {}  # the reads of those that were finishes
        self._echoes = request.echo_events  # chat's echo chunks that may still come
        self.tokens = 0  # output tokens the events counted exactly (Facts.tokens)
        self.choices: dict[int, _Choice] = {}
        self._zero: _Choice | None = None  # choices[0], for the common event's fast path
        self.finish_reason: str | None = None  # raw, as the backend wrote it
        self.finishes: dict[int, str] = {}  # each choice's raw finish reason, by index
        self.finish_reads: dict[int, float] = {}  # the read that carried each one
        self.usage: dict[str, Any] | None = None
        self.engine: object = None  # the engine's `metrics` object as sent
        self.timings: object = None  # llama.cpp's `timings` object as sent
        # llama.cpp's tasks, by choice: each prompt of a batch and each of its n choices is
        # a task of its own, whose last event carries its own usage and timings: the finish
        # chunk, or chat's usage chunk right after it (`_task`)
        self.tasks: dict[int, Facts] | None = None
        self._finished: int | None = None  # the choice of the last finish seen
        self.first_choice = 0  # the choice of the first token
        self.overhead: float | None = None  # the proxy's own time so far
        self.stream_error: object = None
        self.done = False
        self.done_read = 0.0  # the read that carried the end marker (once `done`)
        self.malformed_events = 0
        self.response_id: str | None = None
        self.response_model: str | None = None
        # the backend's `system_fingerprint`, from the event that carried usage or a finish
        # (only those are read for it: nothing per content chunk)
        self.fingerprint: str | None = None
        self._output: Collected | None = None  # generated texts, collected (collect_text)
        self._decoder = self.api.decoder(max_event_bytes)
        # The stream's repeating content event, once one has been parsed and proven
        # (proxy/core/template.py); learning is tried on the first plain event only.
        self._template: EventTemplate | None = None
        self._learn = not collect_text and bool(self.api.text_openings)
        self._body: list[bytes] = []
        self._kept = 0
        self._ends: BodyEnds | None = None  # a body past MAX_KEPT_BODY: its ends alone
        # its ends held no member to read: not the body's fault (never malformed), a
        # limit of the proxy's, which the exchange counts (stage "body_too_large")
        self.unread_body = False
        # Content kinds (issue 26), instants as `now` was given.
        self.first_answer: float | None = None
        self.last_answer: float | None = None
        self.first_reasoning: float | None = None
        self.last_reasoning: float | None = None
        self.first_tool_call: float | None = None
        self.reasoning_events = 0
        # reasoning tokens whose text vLLM held back: held outputs (Facts.held_reasoning),
        # no reasoning events (no text, no instant), yet each one a reasoning token
        self.held_reasoning = 0
        # a non-streaming body of reasoning alone: no answer's text, no tool call
        self.reasoned_whole = False
        # a non-streaming body of nothing: no answer's text, no tool call, no reasoning
        self.empty_whole = False
        # the reasoning's texts (of a body's whole answer always, of a stream's collected)
        self._reasoned: Collected | None = None
        # some reasoning came without its text (a summary in its place): the texts kept
        # are not all of it, so they bound no count (`reasoning_ceiling`)
        self._reasoning_untold = False
        self.tools: ToolCalls | None = None
        self._fast: Facts | None = None  # the shared answer the inline path counts
        self._run = 0  # choice 0's events when the current run began
        self._relearns = RELEARNS if self._learn else 0
        # A stream asked for that came under another label (`open`): its first non-blank
        # bytes, until they tell an event stream from a body (`_sniff`).
        self._sniffing = False
        self._seen = b""
        self.relabelled = False  # it was an event stream, measured as one
        # told once, when it is found to be one (the relay's usage stripping cannot act)
        self.on_relabelled: Callable[[], None] | None = None

    # -- the relay's side -------------------------------------------------------------

    def open(
        self, status: int, content_type: str, now: float, metadata: bytes | None = None
    ) -> None:
        """Upstream response headers arrived; `metadata` is the value of a `metadata`
        header, if the response had one."""
        self.status = status
        self.first_byte = now
        self.streaming = status < 400 and content_type.startswith(self.api.stream_type)
        # A binary answer, not JSON gone wrong: embeddings and pooling asked for with
        # `encoding_format: "bytes"` or `"bytes_only"` (vllm/entrypoints/pooling/utils.py,
        # build_pooling_bytes_streaming_response). With "bytes", vLLM puts the answer's
        # JSON account (id, model, the vectors' offsets, usage) in a `metadata` header.
        self.binary = content_type.startswith("application/octet-stream")
        self.metadata = metadata if self.binary else None
        # Some gateways send a stream as `application/json` (or with no type at all): a
        # stream asked for, on an API whose streams are events, is read as one when its
        # first bytes open an event stream (`_sniff`). Ollama's lines begin as a JSON body.
        self._sniffing = (
            status < 400
            and not self.streaming
            and not self.binary
            and self.request.stream
            and not self.api.ndjson
        )

    def sent(self, read: float, now: float) -> None:
        """The request, whose body was read at `read`, went to the upstream at `now`."""
        self.overhead = now - read

    def relayed(self, now: float) -> None:
        """The response head, in at `first_byte`, went out to the client at `now`."""
        if self.overhead is not None and self.first_byte is not None:
            self.overhead += now - self.first_byte

    def feed(self, chunk: bytes, now: float) -> None:
        """A chunk that was just relayed to the client, read from the network at `now`."""
        if self.streaming:
            if self._echoes:
                self._feed_awaiting_echo(chunk, now)
                return
            event, collect, template = self.api.event, self._collect, self._template
            for payload in self._decoder.feed(chunk):
                if template is not None and template.fits(payload):
                    facts = template.facts  # the same bytes around a new text: no parse
                else:
                    facts = event(payload, collect, self.response_id is None)
                    if self._learn and facts.plain:
                        self._learn = False
                        template = self._template = learn(self.api, payload, facts)
                if facts is self._fast:  # the common event, inline: one choice, one kind
                    zero = self._zero
                    assert zero is not None  # set with _fast
                    self.content_events += 1
                    self.last_token = now
                    self.itl.append(now - zero.last)
                    zero.last = now
                    zero.events += 1
                else:
                    self._apply(facts, now)
        elif self._sniffing:
            self._sniff(chunk, now)
        elif self._kept <= MAX_KEPT_BODY:
            self._body.append(chunk)
            self._kept += len(chunk)
            if self._kept > MAX_KEPT_BODY:  # once: from here only its ends are kept
                self._ends, self._body = BodyEnds(self._body), []
        else:
            ends = self._ends
            assert ends is not None  # made as the body passed MAX_KEPT_BODY
            ends.feed(chunk)

    def _sniff(self, chunk: bytes, now: float) -> None:
        """`feed` while a stream asked for came under another label, until its first
        non-blank bytes tell: an event stream opens with a field or a comment
        (SSE_OPENINGS), which no JSON document begins with; anything else is the body it
        was labelled. Blanks before them carry nothing to either, and are not kept; the
        start of an opening split over reads ("da") waits for the next. What was seen is
        then fed as one read at `now`, the read that told."""
        seen = self._seen + chunk if self._seen else chunk.lstrip()
        if not seen:
            return
        if seen.startswith(SSE_OPENINGS):
            self._sniffing, self._seen = False, b""
            self.streaming = self.relabelled = True
            if self.on_relabelled is not None:
                self.on_relabelled()
        elif len(seen) < _LONGEST_OPENING and any(o.startswith(seen) for o in SSE_OPENINGS):
            self._seen = seen
            return
        else:
            self._sniffing, self._seen = False, b""
        self.feed(seen, now)

    def _feed_awaiting_echo(self, chunk: bytes, now: float) -> None:
        """`feed` while chat's echo may still come: each event parsed with its text."""
        for payload in self._decoder.feed(chunk):
            self._apply(self._event_or_echo(payload), now)

    def _event_or_echo(self, payload: bytes) -> Facts:
        """An event's facts, where chat's echo (RequestInfo.echo_events) may still come:
        a content event whose text is the echo's is no output and no first token (what
        else its chunk says, continuous usage or identity, still counts); the first
        content event that is not ends the wait, as a backend that does not echo
        (llama-server, or vLLM for a message it renders empty) streams a token there."""
        identify = self.response_id is None
        if not self._echoes:
            return self.api.event(payload, self._collect, identify)
        facts = self.api.event(payload, True, identify)
        if facts.content is None:
            return facts
        if facts.content == "text" and "".join(facts.texts or ()) == self.request.echo_text:
            self._echoes -= 1
            return replace(facts, content=None, texts=None, reasoning=None, calls=None)
        self._echoes = 0
        return facts if self._collect else self.api.event(payload, False, identify)

    def end_of_stream(self, now: float) -> None:
        """The upstream body ended cleanly: dispatch a final event that lacked its blank line."""
        if self.streaming:
            for payload in self._decoder.flush():
                self._apply(self._event_or_echo(payload), now)
        elif self._seen:  # a body that ended before it told what it was: kept as one
            self._sniffing = False
            self.feed(self._seen, now)
            self._seen = b""

    def fail(self) -> None:
        """Measuring this response broke (the relay caught it): stop and keep what is safe."""
        self.failed = True

    # -- facts ------------------------------------------------------------------------

    def _end_run(self) -> None:
        """Account for the inline path's run of one kind on choice 0 (see above)."""
        run, zero = self._fast, self._zero
        if run is None or zero is None:
            return
        self._fast = None
        counted = zero.events - self._run
        if counted:
            kind = run.content
            if kind == "reasoning":
                self.reasoning_events += counted
                self.last_reasoning = zero.last
                if zero.reasoning is not None:  # opened by the run's first event
                    zero.reasoning.add(counted, zero.last)
            elif kind == "text":
                self.last_answer = zero.last
                if zero.answer is not None:
                    zero.answer.add(counted, zero.last)

    def _kind(self, facts: Facts, kind: str, now: float) -> None:
        """The first answer, reasoning span and tool calls, from one content event."""
        if facts.reasoning is not None:  # the reasoning's end came with the answer's start
            self._reasoning(facts.reasoning if self._collect else None, facts.choices[0], now)
        if kind == "text":
            if self.first_answer is None:
                self.first_answer = now
            self.last_answer = now
        elif kind == "reasoning":
            self._reasoning(facts.texts, facts.choices[0], now)
        elif kind == "tool" and self.first_tool_call is None:
            self.first_tool_call = now

    def _reasoning(self, texts: list[str] | None, choice: int, now: float) -> None:
        """One event of reasoning, its text kept under its choice for a tokenizer when
        collected."""
        if self.first_reasoning is None:
            self.first_reasoning = now
        self.last_reasoning = now
        self.reasoning_events += 1
        if texts:
            self._keep_reasoning(texts, choice)
        elif self._collect:  # collected, yet no text: not the reasoning's (a summary's)
            self._reasoning_untold = True

    def _apply(self, facts: Facts, now: float) -> None:
        if facts.calls is not None:
            tools = self.tools
            for piece in facts.calls:
                if tools is None:
                    if piece.closes and not piece.opens:
                        continue  # a block that was no call ended
                    tools = self.tools = ToolCalls(now)
                    if self.first_tool_call is None:
                        self.first_tool_call = now
                tools.add(piece, now)
        if facts.content is not None:
            self._end_run()
            self._kind(facts, facts.content, now)
            self.content_events += 1
            if self.first_token is None:
                self.first_token = now
                self.first_choice = facts.choices[0]
            self.last_token = now
            choices, kind, reasoned = self.choices, facts.content, facts.reasoning is not None
            for index in facts.choices:
                choice = choices.get(index)
                if choice is None:
                    choice = choices[index] = _Choice(now)
                    if index == 0:
                        self._zero = choice
                else:
                    self.itl.append(now - choice.last)
                    choice.last = now
                    choice.events += 1
                if reasoned:  # the reasoning's end came with the answer's start
                    choice.phase("reasoning", now)
                choice.phase(kind, now)
            if facts.plain and self._zero is not None:  # a run for the inline path begins
                self._fast = facts
                self._run = self._zero.events
                template = self._template
                if template is not None and template.facts is not facts and self._relearns:
                    self._relearns -= 1  # another kind: learn its template once more
                    self._learn = True
        elif facts.held:
            self.held_events += 1
            if facts.held_reasoning:
                self.held_reasoning += 1
            if facts.finish is not None:
                self.held_finishes[facts.finish_choice] = now
        elif facts.malformed:
            self.malformed_events += 1
            return
        if facts.tokens:
            self.tokens += facts.tokens
        if facts.texts is not None:
            # an event that carries several choices' content at once gives their texts as
            # one list: kept under its first choice (vLLM and llama-server stream one
            # choice an event; a body is split by `_body_texts`)
            self._keep(facts.texts, facts.choices[0])
        if facts.finish is not None:
            self.finish_reason = self.finishes[facts.finish_choice] = facts.finish
            self.finish_reads[facts.finish_choice] = now
            if facts.fingerprint is not None:
                self.fingerprint = facts.fingerprint
        if facts.timings is not None:
            self._task(facts)
        if facts.finish is not None:
            self._finished = facts.finish_choice
        if facts.usage is not None:
            self.usage = (
                facts.usage if self.usage is None else self.api.merge_usage(self.usage, facts.usage)
            )
            if facts.fingerprint is not None:
                self.fingerprint = facts.fingerprint
        if facts.error is not None:
            self.stream_error = facts.error
        if facts.engine is not None:
            self.engine = facts.engine
        if facts.timings is not None:
            self.timings = facts.timings
        if facts.end and not self.done:
            self.done = True
            self.done_read = now
        if facts.response_id is not None and self.response_id is None:
            self.response_id = facts.response_id
            self.response_model = facts.response_model

    def _task(self, facts: Facts) -> None:
        """An event with llama.cpp's `timings`: a task's last, kept under its choice. Each
        task writes its own (tools/server/server-task.cpp): /v1/completions and the native
        /completion on the finish chunk with its usage; chat on the finish chunk without
        usage, and with include_usage on a usage chunk with no choices that it writes right
        after its finish chunk (to_json_oaicompat_chat_stream, one result's chunks written
        together), so that one belongs to the finish before it. Without a finish before
        it, it is the stream's one usage and no task's."""
        if facts.finish is not None:
            choice = facts.finish_choice
        elif facts.usage is not None and self._finished is not None:
            choice = self._finished
        else:
            return
        if self.tasks is None:
            self.tasks = {}
        self.tasks[choice] = facts

    def _keep(self, texts: list[str], choice: int) -> None:
        """Generated texts collected, under their choice (the store made at the first)."""
        output = self._output
        if output is None:
            output = self._output = Collected()
        output.add(texts, choice)

    def _keep_reasoning(self, texts: list[str], choice: int) -> None:
        """Reasoning texts kept, under their choice (the store made at the first)."""
        reasoned = self._reasoned
        if reasoned is None:
            reasoned = self._reasoned = Collected()
        reasoned.add(texts, choice)

    @property
    def texts(self) -> list[str]:
        """The generated texts collected (collect_text), every choice's, in the order they
        came: read, never changed, by whoever did not collect them."""
        return [] if self._output is None else self._output.texts

    @property
    def reasoning_texts(self) -> list[str]:
        """The reasoning's texts kept, every choice's, in the order they came."""
        return [] if self._reasoned is None else self._reasoned.texts

    # -- the end ----------------------------------------------------------------------

    def body(self) -> bytes:
        """The body kept: all of it, or its head where it passed MAX_KEPT_BODY (as much as
        an error body is read from: proxy/core/errors.py MAX_ERROR_BODY)."""
        ends = self._ends
        return b"".join(self._body) if ends is None else ends.head

    def _ended(self) -> bool:
        """The stream reached its API's clean end: its end marker, or where a finish reason
        ends a stream, a finish for every choice that streamed (with n > 1 each choice
        finishes alone, so a stream cut after the first one's finish is cut short)."""
        if self.done:
            return True
        if not self.api.finish_ends_stream or self.finish_reason is None:
            return False
        due = self.request.choices_due
        if due > 1 and not all(choice in self.finishes for choice in range(due)):
            return False
        return self.choices.keys() <= self.finishes.keys()

    def answered_at(self) -> float | None:
        """When a stream that reached its clean end (`_ended`) was whole: the read that
        carried its end marker, else its last finish (where a finish ends the stream).
        None for a stream not ended, or no stream. A client that leaves after this left
        with the whole answer (the OpenAI SDK closes at [DONE], before the terminator)."""
        if not self.streaming or not self._ended():
            return None
        if self.done:
            return self.done_read
        return max(self.finish_reads.values(), default=None)

    def outcome(self) -> tuple[ErrorType | None, str | None]:
        """The error type (None for success) judged from what was seen, for a response that
        reached its end without a transport failure."""
        if self.status >= 400:
            body = self.body()
            return classify_response(self.status, body), error_message(body)
        if self.streaming:
            return classify_stream_end(self.stream_error, self._ended(), self.api.end_marker)
        self._parse_body()
        return None, None

    def _parse_body(self) -> None:
        """A non-streaming success: the Api reads usage, finish reason and identity, from
        the body, or for a binary answer from its `metadata` header (none: nothing known)."""
        if self.binary and self.metadata is None:
            return
        if self._ends is not None and self.metadata is None:
            self._parse_ends(self._ends)
            return
        try:
            obj = orjson.loads(self.body() if self.metadata is None else self.metadata)
        except orjson.JSONDecodeError:
            self.malformed_events += 1
            return
        if type(obj) is list:
            self._parse_answers(obj)
            return
        if type(obj) is not dict:
            return
        facts = self.api.body(obj, self._collect)
        if facts.timings is not None and several_prompts(self.request.prompt):
            # llama-server's merged answer to a list of prompts: its usage is the first
            # prompt's alone (proxy/core/llamacpp.py several_tasks), no count of the request
            facts = replace(facts, usage=None)
        if facts.calls is None and not self.api.answered(obj):
            if facts.reasoning is not None:
                self.reasoned_whole = True
            else:
                self.empty_whole = True
        if facts.texts is not None or facts.reasoning is not None:
            facts = self._body_texts(obj, facts)
        self.response_id = None  # the body's identity wins
        if facts.calls is not None:  # whole calls: judged as a stream's, not timed (so
            # made here: `_apply` times a stream's first call; it finds these closed)
            self.tools = ToolCalls(0.0, timed=False)
            for piece in facts.calls:
                self.tools.add(piece, 0.0)
        self._apply(facts, 0.0)
        if facts.finishes is not None:
            self.finishes.update(facts.finishes)

    def _parse_ends(self, ends: BodyEnds) -> None:
        """A success too large to keep whole, read from its two ends (proxy/core/
        json_ends.py): its usage, finish, identity and engine figures, where they lie
        there. The Api's parser gets what the ends hold, and its texts, reasoning and
        tool calls are dropped: they are of whatever of the middle an end held, not of
        the answer. Ends that hold no member are no malformed body: the proxy cut it
        (`unread_body`)."""
        obj = ends.read()
        if obj is None:
            self.unread_body = True
            return
        facts = self.api.body(obj, False)
        if facts.timings is not None and several_prompts(self.request.prompt):
            facts = replace(facts, usage=None)  # as `_parse_body` says
        self.response_id = None  # the body's identity wins
        self._apply(replace(facts, texts=None, reasoning=None, calls=None), 0.0)
        if facts.finishes is not None:
            self.finishes.update(facts.finishes)

    def _parse_answers(self, answers: list[Any]) -> None:
        """A JSON array of answers, one a prompt: llama-server's native `/completion`
        given a list of prompts, not streamed (server-context.cpp, handle_completions_impl:
        `arr.push_back(res->to_json())` for each task's result). Each is read as the
        streamed case reads that prompt's last object: a task under its `index`, the
        tasks' counts added up, each one's finish its choice's."""
        for position, answer in enumerate(answers):
            if type(answer) is not dict:
                continue
            facts = self.api.body(answer, self._collect)
            index = answer.get("index", position)
            index = index if type(index) is int else position
            if facts.texts:
                self._keep(facts.texts, index)
            facts = replace(facts, texts=None, reasoning=None, finish_choice=index)
            self._apply(facts, 0.0)

    def _body_texts(self, obj: dict[str, Any], facts: Facts) -> Facts:
        """A body's collected texts, and its reasoning (kept for a tokenizer, where usage
        counts none), under their choices' indices. The Api reads a body of several
        `choices` (n > 1, a batch of prompts) into one list of each: each choice is read
        again alone for its own (once a request, and only when it has either). A body
        without `choices` (Messages, Responses) is one answer: choice 0. The facts go on
        without them, kept here already."""
        choices = obj.get("choices")
        pieces: list[tuple[object, list[str] | None, list[str] | None]]
        if type(choices) is list and len(choices) > 1:
            pieces = []
            for choice in choices:
                alone = self.api.body({"choices": [choice]}, self._collect)
                pieces.append((choice, alone.texts, alone.reasoning))
        else:
            only = choices[0] if type(choices) is list and choices else None
            pieces = [(only, facts.texts, facts.reasoning)]
        for choice, texts, reasoning in pieces:
            index = choice.get("index", 0) if type(choice) is dict else 0
            index = index if type(index) is int else 0
            if texts:
                self._keep(texts, index)
            if reasoning:
                self._keep_reasoning(reasoning, index)
            elif reasoning is not None:  # it reasoned, its text not given whole (a summary)
                self._reasoning_untold = True
        return replace(facts, texts=None, reasoning=None)

    def choice_outputs(self) -> list[tuple[list[str], Any]]:
        """Each choice's collected texts, by choice index, with the prompt an `echo` put
        before them (None without echo): what a tokenizer counts as the output, choice by
        choice, as vLLM counts each choice's token ids and adds them up."""
        echoed = self.request.echoed
        kept = [] if self._output is None else self._output.by_choice()
        return [(texts, echoed[i] if 0 <= i < len(echoed) else None) for i, texts in kept]

    def choice_reasoning(self) -> list[list[str]]:
        """Each choice's reasoning texts, by choice index: what a tokenizer counts as the
        reasoning, choice by choice, as it counts the output."""
        return [] if self._reasoned is None else [t for _, t in self._reasoned.by_choice()]

    def echoed_prompts(self) -> list[Any]:
        """The prompts an `echo` put before the texts collected: one per choice that
        answered (streamed content, or finished), by choice index."""
        echoed = self.request.echoed
        if not echoed:
            return []
        answered = self.choices.keys() | self.finishes.keys()
        return [echoed[i] for i in sorted(answered) if 0 <= i < len(echoed)]

    def counts_from_usage(self) -> TokenCounts | None:
        tasks = self.tasks
        if tasks is not None and len(tasks) > 1:
            added = self._tasks_counts(tasks, self._usage_counts)
            if added is not None:
                return added
        usage = self.usage
        return self.api.counts(usage) if usage else None

    def _usage_counts(self, facts: Facts) -> TokenCounts | None:
        return self.api.counts(facts.usage) if facts.usage else None

    def _tasks_counts(
        self, tasks: dict[int, Facts], count: Callable[[Facts], TokenCounts | None]
    ) -> TokenCounts | None:
        """llama.cpp's tasks' counts (`count`: from each one's usage, or its timings) added
        up. Every task counts its own output. The prompt, and its cached tokens, once a
        prompt: a batch's prompts differ, but the n tasks of one prompt share it, which the
        server evaluates once and copies to the others' slots (server-context.cpp,
        copy_state_to, stats included, so each says the whole prompt). Their indices are
        `prompt * n + choice` (server-queue.cpp, post_tasks), so the first of each n
        counts it. None when one of them counts nothing."""
        each = self._choices_asked()
        counted: list[TokenCounts] = []
        prompts: dict[int, TokenCounts] = {}
        for index in sorted(tasks):
            found = count(tasks[index])
            if found is None or found.output is None:
                return None
            counted.append(found)
            prompts.setdefault(index // each, found)
        prompt = [p.prompt for p in prompts.values()]
        cached = [p.cached for p in prompts.values() if p.cached is not None]
        written = [p.cache_write for p in prompts.values() if p.cache_write is not None]
        return TokenCounts(
            prompt=None if None in prompt else sum(p for p in prompt if p is not None),
            output=sum(p.output for p in counted if p.output is not None),
            cached=sum(cached) if cached else None,
            source=counted[0].source,  # usage's, or the engine's (llama.cpp's /completion)
            cache_write=sum(written) if written else None,
        )

    def _choices_asked(self) -> int:
        """The tasks llama-server runs each prompt (`n_cmpl`, else its fallback `n`, on
        any route: RequestOptions.llama_choices)."""
        options = self.request.options
        n = options.llama_choices if options is not None else None
        return n if n is not None and n > 1 else 1

    def counts_from_engine(self, counts: TokenCounts | None) -> TokenCounts | None:
        """Usage's counts with the cached tokens from the engine's own account where usage
        has none; without usage, the engine's counts (llama.cpp: the prompt is prompt_n +
        cache_n, the output predicted_n), every llama.cpp task's added up."""
        tasks = self.tasks
        if counts is None and tasks is not None and len(tasks) > 1:
            added = self._tasks_counts(tasks, _timings_counts)
            if added is not None:
                return added
        engine = self._engine()
        if engine is None or (engine.output_tokens is None and engine.cached_tokens is None):
            return counts
        if counts is not None:
            if counts.cached is None:
                counts.cached = engine.cached_tokens
            return counts
        return _engine_counts(engine)

    def _engine(self) -> EngineMetrics | None:
        """The engine's figures, from whichever engine's object the response carried."""
        if self.engine is not None:
            return self.api.engine_figures(self.engine)
        if self.timings is not None:
            timings = self.timings
            tasks = self.tasks
            if tasks is not None and len(tasks) > 1 and self.first_choice in tasks:
                timings = tasks[self.first_choice].timings  # the task whose token came first
            return timings_metrics(timings)
        return None

    def counts_from_chunks(self) -> TokenCounts:
        """The engine outputs a stream's events stand for: its content events and those
        that streamed no content (Facts.held: text held back, an EOS's finish). One event
        is one engine output, a token where vLLM streams every step (its default
        --stream-interval 1 and no merged steps), several tokens otherwise: a lower bound."""
        if not self.streaming or not self.api.generative:
            return TokenCounts(None, None, None, TokenSource.NONE)
        return TokenCounts(None, self.content_events + self.held_events, None, TokenSource.CHUNKS)

    async def finish(
        self,
        *,
        end: float,
        started_at: float,
        status_code: int,
        error_type: ErrorType | None,
        error_message: str | None,
        counter: Counter | None = None,
        trace_id: str | None = None,
        redact: Callable[[str], str] | None = None,
    ) -> Measurement:
        """The one finish sequence: outcome -> usage counts -> token ids the stream carried
        -> tokenizer -> content events.

        `error_type` is what the transport decided (None when the body ended cleanly)."""
        if error_message is not None and redact is not None:  # whatever said it
            error_message = redact(error_message)
        if self.failed:
            return bare_record(
                self.request,
                status_code=status_code,
                started_at=started_at,
                e2e=end - self.start,
                error_type=error_type,
                error_message=error_message,
                ttfb=None if self.first_byte is None else self.first_byte - self.start,
                trace_id=trace_id,
            )
        if error_type is ErrorType.CLIENT_CANCELLED and self.request.detached and self.streaming:
            # A background Response generates on without its reader (vLLM runs it in a
            # task of its own, responses/serving.py:537-589): its client left only its copy
            # of the stream, which a GET may read again. So no error, no finish yet, and no
            # tokens here: its usage never reaches this reader, as for the acknowledgement
            # not streamed. The first retrieval that sees the response finished counts them
            # (proxy/core/background.py); one its reader left is this case again.
            self.finish_reason = self.finish_reason or "in_progress"
            return self.measurement(
                end=end,
                started_at=started_at,
                status_code=status_code,
                counts=TokenCounts(None, None, None, TokenSource.NONE),
                error_type=None,
                error_message=None,
                trace_id=trace_id,
            )
        if error_type is None:
            error_type, error_message = self.outcome()
            if error_message is not None and redact is not None:
                error_message = redact(error_message)
        counts = self.counts_from_engine(self.counts_from_usage())
        if counts is None and self.tokens:
            counts = TokenCounts(
                self.request.prompt_tokens, self.tokens, None, TokenSource.TOKEN_IDS
            )
        if (
            counts is None
            and counter is not None
            and error_type in _COUNTED
            and self._ends is None  # a body read from its ends kept no text to count
        ):
            counts = await counter.count(self)
        if counts is None:
            counts = self.counts_from_chunks()
        if self.usage is not None and counts.source is not TokenSource.USAGE:
            # usage that came before the output's count and no more (a Messages stream cut
            # after message_start): its exact prompt wins over one counted otherwise
            prompt, cached, written = self.api.prompt_counts(self.usage)
            if prompt is not None:
                counts.prompt = prompt
                counts.cached = cached if cached is not None else counts.cached
                counts.cache_write = written if written is not None else counts.cache_write
        self._end_run()
        counted = None
        if self.reasoning_texts and counter is not None and not self.reasoning_from_usage():
            counted = await counter.count_reasoning(self)
        return self.measurement(
            end=end,
            started_at=started_at,
            status_code=status_code,
            counts=counts,
            error_type=error_type,
            error_message=error_message,
            trace_id=trace_id,
            reasoning=self.reasoning(counted, exact_output(counts)),
        )

    def reasoning(
        self, counted: int | None = None, output: int | None = None
    ) -> tuple[int, str] | None:
        """(reasoning tokens, their source): usage's, where the stream does not contradict
        it; else every output token (`output`, an exact count) when the stream carried
        reasoning and nothing else; else `counted` (a tokenizer's count of the reasoning
        texts), no more than the exact output leaves it (`_room`: the random model's
        broken UTF-8 arrives as U+FFFD and re-tokenizes long, 46 for 40 output tokens);
        else the reasoning events, the held ones included; None when there was none. A
        body of reasoning alone refuses usage below its output (`_whole_says_more`)."""
        found = self.reasoning_from_usage()
        if found and output and self._whole_says_more(found[0], output):
            found = None
        if not found and output and self.only_reasoned():
            found = output, "output"
        if not found and counted:
            room = self._room(output)
            if room is None or counted <= room:
                found = counted, TokenSource.TOKENIZER.value
            elif room > 0:
                found = room, TokenSource.TOKENIZER.value
        events = self.reasoning_events + self.held_reasoning
        if not found and events:
            found = events, "events"
        return found

    def _whole_says_more(self, reasoning: int, output: int) -> bool:
        """A body of reasoning alone (`reasoned_whole`) spent its `output` tokens on
        reasoning but for a `<think>`, a `</think>` and the EOS a choice: a `reasoning`
        count below that is contradicted. vLLM's non-streaming parser drops the text before
        a late `<think>` and counts only after it (extract_reasoning and
        count_reasoning_tokens, vllm/reasoning/basic_parsers.py): usage 4 of 40, where the
        same generation streamed 24 reasoning events. Not where the request offered tools:
        the rest may be a call's tokens that left no call (a harmony call's header, not
        reasoning to vllm/parser/harmony.py; a forced call cut by `length`; a call an
        engine-based parser strips under `tool_choice: "none"`)."""
        if not self.reasoned_whole or self.tools_offered():
            return False
        return reasoning < output - WHOLE_NOT_REASONING * max(1, len(self.finishes))

    def _room(self, output: int | None) -> int | None:
        """The most reasoning tokens an output of `output` tokens can hold: less the answer
        and tool-call events, each at least a token. None when the output is not known."""
        if output is None:
            return None
        return output - (self.content_events - self.reasoning_events)

    def only_reasoned(self) -> bool:
        """The stream carried reasoning and no answer nor tool call: every token it
        generated was reasoning (a stream cut off by max_tokens while it reasoned); or a
        body did (`reasoned_whole`). Not where the request offered tools: the tokens after
        the reasoning may have gone into a call the tool parser held back and never sent
        (`tools_offered`), and the stream alone cannot tell that from reasoning."""
        if self.reasoned_whole:
            return True
        return (
            self.reasoning_events + self.held_reasoning > 0
            and self.first_answer is None
            and self.first_tool_call is None
            and not self.tools_offered()
        )

    def reasoning_from_usage(self) -> tuple[int, str] | None:
        """(reasoning tokens, "usage") when usage reports more than 0 and the stream does
        not prove it wrong. vLLM counts only the tokens between a generated <think> and
        </think> (count_reasoning_tokens in vllm/reasoning/basic_parsers.py), by nesting
        depth, while its parsers stream everything before the first </think> as reasoning:
        a template that opens <think> in the prompt reports 0, and a model that writes
        <think> or </think> more than once gets a count the stream contradicts. Each
        streamed event is at least one token, so a count below the reasoning events (the
        held ones included: `held_reasoning`), or above the output less the other events
        (`_room`), is wrong: the stream is counted instead.
        A whole answer has no events; its reasoning text bounds the count instead
        (`reasoning_ceiling`), and above it usage is wrong: a tokenizer counts the text, or
        nothing is claimed."""
        usage = self.usage
        found = self.api.reasoning_tokens(usage) if usage else None
        if not found or found < self.reasoning_events + self.held_reasoning:
            return None
        ceiling = self.reasoning_ceiling()
        if ceiling is not None and found > ceiling:
            return None
        counts = self.counts_from_usage()
        room = self._room(counts.output if counts is not None else None)
        if room is not None and found > room:
            return None
        return found, TokenSource.USAGE.value

    def reasoning_ceiling(self) -> int | None:
        """The most tokens the reasoning texts kept can stand for (a body's always, a
        stream's when collected), None when none was kept: each token of a byte-level BPE
        gives at least one byte of text, and the parser's reasoning is the text between
        the first <think> and the first </think> (vllm/reasoning/basic_parsers.py,
        extract_reasoning), any other marker in it kept as text, so N UTF-8 bytes are at
        most N tokens,
        plus a character each choice's detokenizer still held at the text's end
        (HELD_BYTES). A token that gives no text at all (a special token vLLM skips) is
        the one thing this leaves out.

        Only where the texts are all the reasoning usage counts, else None:
        - not where some reasoning came without its text (`_reasoning_untold`): a summary
          (Responses' `summary`, `reasoning_summary_text`) is not the reasoning;
        - not where the request offered tools or the answer called one: vLLM's harmony
          parser (gpt-oss) counts as reasoning every token on the analysis channel and
          every commentary token written to a recipient (vllm/parser/harmony.py,
          `_is_reasoning_token`), a call's text among them, which goes into the call, not
          the reasoning; and a call cut short or to a name no tool has leaves no call to
          see."""
        reasoned = self._reasoned
        if reasoned is None or self._reasoning_untold or self.called_or_offered_tools():
            return None
        held = HELD_BYTES * len(reasoned.by_choice())
        return sum(len(text.encode()) for text in reasoned.texts) + held

    def called_or_offered_tools(self) -> bool:
        """The answer carried a tool call (or a built-in tool's content), or the request
        offered tools (`tools_offered`)."""
        called = self.tools is not None or self.first_tool_call is not None
        return called or self.tools_offered()

    def tools_offered(self) -> bool:
        """The request offered tools, so a tool parser may have held generated text back:
        vLLM streams no chunk for a token its parser keeps (a <tool_call> it never turned
        into a call, chat_completion/serving.py: `delta_message is None` -> `continue`),
        so tokens the output counts may have reached the client as nothing. `tool_choice:
        "none"` still counts: an engine-based tool parser runs on it and strips the calls
        it finds (vllm/parser/abstract_parser.py, `_extract_tool_calls` and its streaming
        twin), so their tokens reach the client as nothing too."""
        template = self.request.template
        return bool(template and template.get("tools"))

    def _held_uncounted(self, source: str) -> bool:
        """The output count may leave out tokens whose steps its span holds, so TPOT and
        decode speed would divide by tokens not seen: a tool parser may have held tokens
        back (`called_or_offered_tools`), and the count is only of what streamed
        (COUNTS_WHAT_STREAMED). vLLM streams no chunk for a token its parser keeps, with
        any n (chat_completion/serving.py: `delta_message is None` -> `continue`); a
        call's markers and name, a `tool_choice` "required" or named call's JSON around
        its arguments, a `<tool_call>` cut by `length` that never became a call. Against
        the real vLLM 0.32, n=2 with a required call: 7 chunks for 80 tokens, a TPOT of 27
        ms where usage's count gave 1.6 ms. A tokenizer's span ends at the last content,
        but holds the tokens kept between the text and a call or between a call's pieces.
        The backend's own count holds them all, and its span runs to the read of the
        finish that ended them (`_ending_reads`)."""
        return source in COUNTS_WHAT_STREAMED and self.called_or_offered_tools()

    def whole_call_first(self) -> bool:
        """The read that carried the stream's first content carried a tool call whole: the
        first call opened there and ended there (its API closed it, or its arguments were a
        whole JSON object by then). Its tokens were all decoded before that read, so the
        TTFT holds them, and the span from it to the end holds only what came after: TPOT
        and decode speed would divide that span by every output token, and the TTFT's part
        outside the engine would be the call's decoding. Ollama sends each call whole once
        its parser has it (server/routes.go ChatHandler's toolParser; GenerateHandler on the
        done line; its /v1 layer one chunk per call, middleware/openai.go); vLLM's tool
        parsers stream a call's name, then its arguments in pieces on later steps
        (vllm/tool_parsers/hermes_tool_parser.py), which keep their figures. Judged once,
        at the end, from the calls kept: nothing per chunk."""
        tools = self.tools
        if tools is None or not tools.timed or not tools.order or tools.first != self.first_token:
            return False
        call = tools.calls[tools.order[0]]
        if call.last != call.first:
            return False
        parts = call.parts
        return call.closed or (parts is not None and is_json_object("".join(parts)))

    def measurement(
        self,
        *,
        end: float,
        started_at: float,
        status_code: int,
        counts: TokenCounts,
        error_type: ErrorType | None,
        error_message: str | None,
        trace_id: str | None = None,
        reasoning: tuple[int, str] | None = None,
    ) -> Measurement:
        self._end_run()
        tpot = tps = None
        whole_call = self.whole_call_first()
        if not self._held_uncounted(counts.source) and not whole_call:
            tpot, tps = self._decode_speed(counts.output, self._ending_reads(counts.source))
        first = self.first_token
        request = self.request
        raw = self.finish_reason
        return Measurement(
            endpoint=request.endpoint,
            model=request.model,
            stream=self.streaming,
            stream_requested=asked_for_stream(request),
            status_code=status_code,
            started_at=started_at,
            ttfb=None if self.first_byte is None else self.first_byte - self.start,
            ttft=None if first is None else first - self.start,
            tpot=tpot,
            decode_tokens_per_second=tps,
            e2e=end - self.start,
            inter_token_latencies=tuple(self.itl),
            prompt_tokens=counts.prompt,
            output_tokens=counts.output,
            cached_prompt_tokens=counts.cached,
            cache_write_tokens=counts.cache_write,
            token_source=counts.source,
            content_events=self.content_events,
            finish_reason=NONE_LABEL if raw is None else self.api.finish_label(raw),
            finish_reasons=self._finish_labels(),
            raw_finish_reason=raw,
            error_type=error_type,
            error_message=error_message,
            response_id=self.response_id or None,
            response_model=self.response_model,
            system_fingerprint=self.fingerprint,
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            trace_id=trace_id,
            engine=self._engine(),
            whole_call_first=whole_call,
            proxy_overhead=self.overhead,
            prefix=prefix_of(request),
            **self._kinds(counts, reasoning, error_type),
            malformed_events=self.malformed_events,
        )

    def _kinds(
        self, counts: TokenCounts, reasoning: tuple[int, str] | None, error: ErrorType | None
    ) -> dict[str, Any]:
        """The record's issue-26 fields: first tokens by kind, tokens by kind, tool calls."""
        start = self.start

        def since(instant: float | None) -> float | None:
            return None if instant is None else instant - start

        tokens, source = reasoning if reasoning is not None else (None, None)
        calls: tuple[ToolCall, ...] = ()
        if self.tools is not None:
            label, finishes = self.api.finish_label, self.finishes
            length = {choice for choice, raw in finishes.items() if label(raw) == "length"}
            # a choice that gave its finish ended cleanly, even where the stream did not
            cut = error is not None or not self._ended()
            cut_short = self.tools.choices() - finishes.keys() if cut else set()
            calls = self.tools.outcomes(length=length, cut_short=cut_short)
        reasoning_tpot = answer_tpot = None
        if tokens is not None:
            reasoning_tpot = self._phase_tpot(tokens, lambda c: c.reasoning)
        # Only a stream that reasoned has an answer phase of its own (else it is `tpot`).
        # Where tools were offered, the answer's count may hold a call's tokens that never
        # streamed (`tools_offered`): its time per token would divide by tokens not seen.
        answer = None if tokens is None or counts.output is None else counts.output - tokens
        if answer is not None and not calls and not self.tools_offered():
            ends = self._ending_reads(counts.source)  # the ending token is the answer's
            answer_tpot = self._phase_tpot(answer, lambda c: c.answer, ends)
        return {
            "first_answer": since(self.first_answer),
            "first_reasoning": since(self.first_reasoning),
            "last_reasoning": since(self.last_reasoning),
            "first_tool_call": since(self.first_tool_call),
            "reasoning_tokens": tokens,
            "reasoning_token_source": source,
            "reasoning_events": self.reasoning_events,
            "reasoning_tpot": reasoning_tpot,
            "answer_tpot": answer_tpot,
            "tool_calls": calls,
            "without_answer": self._without_answer(counts, error),
        }

    def _without_answer(self, counts: TokenCounts, error: ErrorType | None) -> str | None:
        """How a generative answer that generated output but delivered no answer token and
        no tool call ended (length, stop, error, cancelled); None otherwise. A stream's
        events tell it. A body not streamed tells it when it holds reasoning alone
        (`reasoned_whole`: vLLM cut by max_tokens inside the reasoning writes no content),
        or nothing at all while its output counts tokens (`empty_whole`: vLLM's answer of
        one EOS with `tool_choice: "required"`, finish `tool_calls`, no call: its stream
        is `stop` by its events), by its finish: only a body that arrived whole is parsed,
        so never error or cancelled."""
        if not self.api.generative:
            return None
        if not self.streaming:
            nothing = self.empty_whole and bool(counts.output)  # it generated, no answer came
            return self._finished_as() if self.reasoned_whole or nothing else None
        if self.first_answer is not None or self.first_tool_call is not None:
            return None
        if not self.content_events and not counts.output:
            return None  # nothing was generated (an error before any output)
        if error is ErrorType.CLIENT_CANCELLED:
            return "cancelled"
        if error is not None:
            return "error"
        return self._finished_as()

    def _finished_as(self) -> str | None:
        """`without_answer` of an answer that ended cleanly: length where its finish says
        it was cut by its token limit, else stop; None where it had not finished."""
        raw = self.finish_reason
        if raw is not None and self.api.finish_label(raw) == NONE_LABEL:
            return None  # not finished yet (a background Response read on elsewhere)
        return "length" if raw is not None and self.api.finish_label(raw) == "length" else "stop"

    def _finish_labels(self) -> tuple[str, ...]:
        """Measurement.finish_reasons: with several choices, each one that streamed or
        finished, by index; () with one (its reason is finish_reason)."""
        indices = self.finishes.keys() | self.choices.keys()
        if len(indices) < 2:
            return ()
        label, finishes = self.api.finish_label, self.finishes
        return tuple(label(finishes[i]) if i in finishes else NONE_LABEL for i in sorted(indices))

    def _phase_tpot(
        self,
        tokens: int,
        phase: Callable[[_Choice], _Phase | None],
        ends: dict[int, float] | None = None,
    ) -> float | None:
        """A phase's time per token, of the median choice as `tpot` is: each choice's
        share of the phase's `tokens` is in proportion to its events of that phase. `ends`:
        the reads that end choices' last phase, where later than its last event
        (`_ending_reads`)."""
        phases = [(i, p) for i, c in self.choices.items() if (p := phase(c)) is not None]
        total = sum(p.events for _, p in phases)
        spans = []
        for index, p in phases:
            share = tokens * p.events / total
            if share >= 2:
                last = max(p.last, ends.get(index, p.last)) if ends else p.last
                if last > p.first:  # a phase all in one read measured no time per token
                    spans.append((last - p.first) / (share - 1))
        if not spans:
            return None
        spans.sort()
        return spans[(len(spans) - 1) // 2]  # the lower median: always a real choice

    def _ending_reads(self, source: str) -> dict[int, float]:
        """The reads of the tokens that ended choices, by index, where the output count
        includes them: a count the backend made (usage, the engine's account, the token
        ids streamed) counts the token that ends a choice, an EOS without text, and the
        finish comes at that token's step, on a read of its own (vLLM: the EOS is in the
        output token ids, v1/core/sched/utils.py check_stop, and every route counts them;
        llama-server's n_decoded and, on a GGUF model, Ollama's eval_count (llama-server's
        predicted_n: ollama llm/llama_server.go:1725), alike; Ollama's MLX runner leaves
        the EOS out of eval_count, x/mlxrunner/pipeline.go checks IsEOS before
        generated++, and nothing on the wire says which runner answered). Text counted by a
        tokenizer leaves that token out, and its read with it: {}.

        A `length` finish adds no token: it rides on the step of the last one, which the
        count holds. That step's read is the finish's where its chunk was an engine output
        of its own (Facts.held): vLLM skips a step whose parser gives no delta unless it
        finishes, and then sends the finish with an empty delta (chat_completion/serving.py,
        `if delta_message is None`; completions' empty `text`), so a last token whose text
        was held back (a tool parser's unfinished call, a partial character) is read only
        there, after the last content, however many held tokens came between. Any other
        `length` finish came with the last content, or in a chunk or event of its own on
        that content's step (OpenAI's and llama-server's `delta: {}`, Messages'
        `message_delta`, Responses' last event, whose response says `incomplete`): its
        read is left out. Messages and Responses drop vLLM's empty deltas before the wire,
        so theirs cannot say whether the last token's text was held back
        (docs/measured.md).

        Chunks counted count a finish only where its chunk was such an engine output (vLLM's
        EOS, or a last token whose text was held back, whatever the reason), and their
        reads are those."""
        held = self.held_finishes
        if source == TokenSource.CHUNKS:
            return held
        if source not in COUNTS_THE_ENDING_TOKEN:
            return {}
        label, finishes = self.api.finish_label, self.finishes
        return {
            i: at
            for i, at in self.finish_reads.items()
            if i in held or label(finishes[i]) != "length"
        }

    def _decode_speed(
        self, output: int | None, ends: dict[int, float]
    ) -> tuple[float | None, float | None]:
        """(TPOT, decode tokens/s) of the median choice; each choice's share of the output
        tokens is in proportion to its content events (all of them for one choice), or its
        own count where each choice counted its own (`_own_outputs`). A choice's span runs
        from its first content read to its last, or to the read of the token that ended it
        when `ends` has a later one. A span of 0 (every token in one read) measured no
        time: such a choice gives neither figure, as decode speed never had one, rather
        than a TPOT of 0 that only says the reads were merged."""
        if output is None or not self.choices:
            return None, None
        own = self._own_outputs(output)
        total = sum(c.events for c in self.choices.values())
        speeds: list[tuple[float, float | None]] = []
        for index, choice in self.choices.items():
            if own is None:
                tokens = output * choice.events / total
            else:
                tokens = float(own[index])  # a float as above: mypyc keeps one representation
                # A token that streamed no text (llama-server sends nothing for one that
                # ends inside a UTF-8 character, and no text for one a stop word may
                # claim: tools/server/server-context.cpp, process_token) is still one of
                # its count: in the span, or before its first read or after its last (a
                # figure short by one step in N-1 at most). More reads than tokens: the
                # count is not this choice's.
                if choice.events + (index in ends) > tokens:
                    continue
            if tokens < 2:
                continue
            span = max(choice.last, ends.get(index, choice.last)) - choice.first
            if span <= 0:
                continue  # every token in one read: no time per token was measured
            speeds.append((span / (tokens - 1), (tokens - 1) / span))
        if not speeds:
            return None, None
        speeds.sort(key=lambda s: s[0])
        return speeds[(len(speeds) - 1) // 2]  # the lower median: always a real choice

    def _own_outputs(self, output: int) -> dict[int, int] | None:
        """Each choice's own output tokens, by index, where every choice that streamed is a
        llama.cpp task whose own account (its usage, else its timings: `_task`) counts it
        and these add up to the record's `output`; None otherwise (vLLM's n > 1, one
        choice, a tokenizer's count). A share in proportion to content events would
        count a token that streamed no event in the other choices' shares."""
        tasks = self.tasks
        if tasks is None or len(tasks) < 2 or not self.choices.keys() <= tasks.keys():
            return None
        for count in (self._usage_counts, _timings_counts):
            own: dict[int, int] = {}
            for index, facts in tasks.items():
                found = count(facts)
                if found is None or found.output is None:
                    break
                own[index] = found.output
            else:
                if sum(own.values()) == output:
                    return own
        return None


def bare_record(
    request: RequestInfo,
    *,
    status_code: int,
    started_at: float,
    e2e: float,
    error_type: ErrorType | None,
    error_message: str | None = None,
    ttfb: float | None = None,
    trace_id: str | None = None,
) -> Measurement:
    """A record with only what is known without reading the response: for requests refused
    before going upstream, and for responses whose measuring broke."""
    return Measurement(
        endpoint=request.endpoint,
        model=request.model,
        stream=request.stream,
        stream_requested=asked_for_stream(request),
        status_code=status_code,
        started_at=started_at,
        ttfb=ttfb,
        ttft=None,
        tpot=None,
        decode_tokens_per_second=None,
        e2e=e2e,
        inter_token_latencies=(),
        prompt_tokens=None,
        output_tokens=None,
        cached_prompt_tokens=None,
        token_source=TokenSource.NONE,
        content_events=0,
        finish_reason=NONE_LABEL,
        error_type=error_type,
        error_message=error_message,
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        trace_id=trace_id,
        prefix=prefix_of(request),
    )


def asked_for_stream(request: RequestInfo) -> bool | None:
    """Whether the client asked for a stream; None when no request was read from its body.
    A request refused at its head (a 413 on its Content-Length) or before its body was all
    in is recorded with an empty body's reading (admission.count_refusal), and a stream
    flag the proxy never saw is not `false`; nor is one in a body it could not decode."""
    return request.stream if request.valid_json else None


def exact_output(counts: TokenCounts) -> int | None:
    """The output count when the backend or the streamed token ids gave it exactly."""
    exact = (TokenSource.USAGE, TokenSource.ENGINE, TokenSource.TOKEN_IDS)
    return counts.output if counts.source in exact else None


__all__ = ["Counter", "StreamObserver", "TokenCounts", "bare_record"]
