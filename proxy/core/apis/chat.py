"""OpenAI chat completions, `POST /v1/chat/completions`, as vLLM serves it.

Wire facts (vllm-project/vllm: vllm/entrypoints/openai/chat_completion/serving.py and
protocol.py): the first streamed chunk carries `delta: {role: "assistant", content: ""}`
and is not a token; generated content arrives in `delta.content`, `delta.reasoning`
(`reasoning_content` in older releases) or `delta.tool_calls`; with n > 1 each chunk
carries one choice with its `index`; usage is streamed only when
`stream_options.include_usage` is set, as a last chunk with `choices: []`; an error after
the 200 is `data: {"error": {...}}` followed by `data: [DONE]`.

The proxy may ask for usage itself (`stream_options.include_usage`) when the client did
not, and the relay then removes that usage-only chunk (proxy/core/strip.py).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, ClassVar

import orjson

from proxy.core.apis.base import (
    END,
    HELD,
    HELD_REASONING,
    MALFORMED,
    NOTHING,
    Api,
    Facts,
    RequestInfo,
    fingerprint,
    identity,
)
from proxy.core.lax import lax_bool, lax_int
from proxy.core.toolcalls import CallPiece

_DELTA_KEYS = (
    ("content", "text"),
    ("reasoning_content", "reasoning"),
    ("reasoning", "reasoning"),
    ("tool_calls", "tool"),
)


#: What a delta carries beside its content's kind (`beside`).
Beside = tuple[list[str] | None, tuple[CallPiece, ...] | None]
_NOTHING_BESIDE: Beside = (None, None)

_FIRST = (0,)
#: The request fields vLLM renders a chat prompt with (proxy/core/chat_prompt.py,
#: template_kwargs, says how it merges them; `add_special_tokens` is for the encoding).
_TEMPLATE_OPTIONS = ("tools", "add_generation_prompt", "continue_final_message",
                     "chat_template_kwargs", "documents", "reasoning_effort",
                     "chat_template", "add_special_tokens")  # fmt: skip
#: Shared answers for the common event: one choice (index 0) with content, nothing else.
_CONTENT = {name: Facts(content=name, plain=True) for name in ("text", "reasoning", "tool")}


class OpenAIGeneration(Api):
    """What chat and text completions share: the `choices` stream, usage, [DONE]."""

    finish_ends_stream: ClassVar[bool] = True
    end_marker: ClassVar[str] = "[DONE] or finish_reason"
    #: Content comes in `choices[i].delta`, which can hold several kinds (`beside`); text
    #: completions' `choices[i].text` holds one.
    deltas: ClassVar[bool] = False

    def usage_requested(self, obj: dict[str, Any]) -> bool:
        options = obj.get("stream_options")
        return isinstance(options, dict) and lax_bool(options.get("include_usage")) is True

    def ask_for_usage(self, obj: dict[str, Any], body: bytes) -> bytes | None:
        """The body with `stream_options.include_usage: true`, or None where the client's
        stream could not then be given back exactly as it would come direct, or where the
        request would not then mean what it meant:

        - n > 1: vLLM stamps `system_fingerprint` on every choice's terminal chunk only
          without include_usage; with it, on the usage chunk alone. Only the terminal chunk
          right before the usage chunk can get it back (proxy/core/strip.py), so the proxy
          does not ask (token counts come from the tokenizer or the chunks).
        - a `stream_options` vLLM refuses (not an object, a flag pydantic cannot read as
          a bool): the client gets vLLM's 400, as direct.
        - a body whose re-encoding would change it: an integer beyond 64 bits (orjson
          reads it as a float), or nesting deeper than orjson writes.

        Without stream_options the field is added to the client's own bytes, which stay
        as they were. `continuous_usage_stats` is sent as false: vLLM puts usage on every
        chunk only when include_usage is also set (vllm/entrypoints/utils.py,
        should_include_usage: `include_continuous_usage = include_usage and
        bool(continuous_usage_stats)`), so the client, which did not set include_usage,
        would get none direct."""
        n = lax_int(obj.get("n"))  # `"n": "2"` is two choices to vLLM too
        if n is not None and n > 1:
            return None
        options = obj.get("stream_options")
        if options is None and "stream_options" not in obj:
            return added_field(body, b'"stream_options":{"include_usage":true}')
        if options is not None and (type(options) is not dict or not _readable(options)):
            return None
        if _LONG_NUMBER.search(body):
            return None
        merged = dict(options) if options is not None else {}
        merged["include_usage"] = True
        if lax_bool(merged.get("continuous_usage_stats")):
            merged["continuous_usage_stats"] = False
        try:
            return orjson.dumps({**obj, "stream_options": merged})
        except (orjson.JSONEncodeError, TypeError):  # deeper than orjson writes
            return None

    def event(self, payload: bytes, collect: bool, identify: bool) -> Facts:
        # The hot path of the hot API: most events are one choice with one piece of
        # content and nothing else, and get a shared, never-mutated answer.
        if payload == b"[DONE]":
            return END
        try:  # base.json_object, inlined: a call per chunk of every chat stream
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return MALFORMED
        if type(obj) is not dict:
            # llama-server streams a batch's tasks with a `data: null` between them (seen
            # from the b1-0c1e570 build .ci/llama makes): no event, nor a malformed one
            return NOTHING if obj is None else MALFORMED
        kind: str | None = None
        held: Facts | None = None  # HELD or HELD_REASONING (`_held_as`)
        finish: Any = None
        texts: list[str] | None = [] if collect else None
        indices: tuple[int, ...] = _FIRST
        calls = reasoning = None
        finish_choice: Any = 0
        choices = obj.get("choices")
        if choices and type(choices) is list:
            if len(choices) == 1:  # vLLM sends one choice per chunk, even with n > 1
                choice = choices[0]
                if type(choice) is dict:
                    kind = self._content(choice, texts)
                    if kind is not None:
                        index = choice.get("index", 0)
                        if index != 0 and type(index) is int:
                            indices = (index,)
                        if kind == "tool":  # only tool-call chunks pay for this
                            calls = call_pieces(choice.get("delta"), indices[0])
                        if self.deltas:
                            delta = choice["delta"]  # a dict: _content found content in it
                            if len(delta) > 1:  # vLLM leaves unset fields out of a delta
                                reasoning, more = beside(delta, kind, indices[0])
                                if more is not None:
                                    calls = more
                    else:  # no content: the role chunk, or an output vLLM held back
                        held = self._held_as(choice)
                    finish = choice.get("finish_reason")
                    if finish is not None:
                        finish_choice = choice.get("index", 0)
            else:
                kind, indices, finish, finish_choice, calls = self._choices(choices, texts)
            if finish is not None and (not finish or type(finish) is not str):
                finish = None
        usage = obj.get("usage")
        if not usage or type(usage) is not dict:
            usage = None
        error = obj.get("error")
        if (
            usage is None
            and finish is None
            and error is None
            and indices is _FIRST
            and not identify
            and not texts
            and calls is None
            and reasoning is None
        ):
            if kind is None:
                return NOTHING if held is None else held
            return _CONTENT[kind]
        facts = Facts(**identity(obj)) if identify else Facts()
        facts.content, facts.choices, facts.finish = kind, indices, finish
        if finish is not None and type(finish_choice) is int:
            facts.finish_choice = finish_choice
        facts.texts, facts.usage, facts.error = texts or None, usage, error
        facts.calls, facts.reasoning = calls, reasoning
        if held is not None:
            facts.held, facts.held_reasoning = True, held.held_reasoning
        if usage is not None:  # vLLM's per-request metrics ride on the usage chunk only
            facts.engine = obj.get("metrics")
        if usage is not None or finish is not None:
            # llama.cpp's timings and vLLM's system_fingerprint ride on the last chunk: the
            # usage chunk when usage was asked for, else the finish chunk
            # (proxy/core/strip.py, MOVED)
            facts.timings = obj.get("timings")
            facts.fingerprint = fingerprint(obj)
        return facts

    def _choices(
        self, choices: list[Any], texts: list[str] | None
    ) -> tuple[str | None, tuple[int, ...], Any, Any, tuple[CallPiece, ...] | None]:
        """(content kind, indices of the choices with content, the last finish reason and
        its choice's index, their tool-call pieces) of an event that carries several
        choices."""
        kind = finish = None
        finish_choice: Any = 0
        content_at: list[int] = []
        calls: list[CallPiece] = []
        for choice in choices:
            if type(choice) is not dict:
                continue
            found = self._content(choice, texts)
            if found is not None:
                kind = found
                index = choice.get("index", 0)
                content_at.append(index if type(index) is int else 0)
                if self.deltas:
                    calls.extend(call_pieces(choice.get("delta"), content_at[-1]) or ())
            reason = choice.get("finish_reason")
            if reason and type(reason) is str:
                finish, finish_choice = reason, choice.get("index", 0)
        indices = tuple(content_at) if content_at else _FIRST
        return kind, indices, finish, finish_choice, tuple(calls) or None

    def _content(self, choice: dict[str, Any], texts: list[str] | None) -> str | None:
        """The kind of content this choice carries (None: none), its text kept in `texts`."""
        raise NotImplementedError

    def _held(self, choice: dict[str, Any]) -> bool:
        """A choice without content (`_content` found none) is still an engine output
        (Facts.held): vLLM skips a choice's step only when it has no delta at all."""
        raise NotImplementedError

    def _held_as(self, choice: dict[str, Any]) -> Facts | None:
        """The shared facts of a choice without content that is a held engine output
        (`_held`), None when it is none. Chat tells a reasoning token apart."""
        return HELD if self._held(choice) else None

    def body(self, obj: dict[str, Any], collect: bool) -> Facts:
        facts = super().body(obj, collect)
        choices = obj.get("choices")
        if type(choices) is list:
            finishes: dict[int, str] = {}
            for choice in choices:
                if type(choice) is not dict:
                    continue
                reason = choice.get("finish_reason")
                if reason and type(reason) is str:
                    index = choice.get("index", 0)
                    facts.finish, facts.finish_choice = reason, index if type(index) is int else 0
                    finishes[facts.finish_choice] = reason
                message = choice.get("message")
                if type(message) is dict:
                    index = choice.get("index", 0)
                    whole(facts, message, index if type(index) is int else 0)
                if collect:
                    if type(message) is dict:  # what a stream's deltas would have carried
                        if facts.texts is None:
                            facts.texts = []
                        generated(message, facts.texts)
                    elif type(choice.get("text")) is str:
                        keep(facts, choice["text"])
            if len(finishes) > 1:
                facts.finishes = finishes
        return facts

    def answered(self, obj: dict[str, Any]) -> bool:
        """A choice's message `content`, or a completion choice's `text`, is not empty."""
        choices = obj.get("choices")
        for choice in choices if type(choices) is list else ():
            if type(choice) is not dict:
                continue
            message = choice.get("message")
            text = message.get("content") if type(message) is dict else choice.get("text")
            if text:
                return True
        return False


#: llama-server serves the same handler without the /v1 (tools/server/server.cpp,
#: `ctx_http.post("/chat/completions", ...)` beside "/v1/chat/completions"); vLLM 0.32 has
#: no such route (a 404): measured only where the backend may be llama-server
#: (proxy/core/apis/__init__.py `LLAMACPP_PATHS`).
WITHOUT_V1 = "/chat/completions"


class Chat(OpenAIGeneration):
    endpoint = "/v1/chat/completions"
    bench_name = "chat"
    takes_messages = True
    paths: ClassVar[tuple[str, ...]] = ("/v1/chat/completions", WITHOUT_V1)
    operation = "chat"
    deltas = True
    text_openings = (b'"delta":{"content":"', b'"delta":{"reasoning":"')
    measures = (
        "TTFT at the first chunk with non-empty delta content, reasoning or tool_calls "
        "(not the role-only first chunk); the first answer at the first non-empty content; "
        "TPOT, ITL, decode speed, tokens from usage "
        "(asked for when the client did not), finish_reason, in-stream errors"
    )

    def prompt(self, obj: dict[str, Any]) -> Any:
        return obj.get("messages")

    def max_tokens(self, obj: dict[str, Any]) -> object:
        """The limit vLLM applies: `max_completion_tokens`, unless it is absent or null,
        then `max_tokens` (chat_completion/protocol.py build_tok_params and serving.py's
        get_max_tokens call: `max_completion_tokens if ... is not None else max_tokens`),
        so a null `max_completion_tokens` beside `max_tokens: 5` is a limit of 5."""
        limit = obj.get("max_completion_tokens")
        return obj.get("max_tokens") if limit is None else limit

    def template(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """The options vLLM renders and encodes the prompt with, as sent: the chat template's
        (chat_completion/protocol.py, build_chat_params; the tools:
        renderers/online_renderer.py, render_chat) and the encoding's `add_special_tokens`
        (build_tok_params). Read as vLLM reads them only when a tokenizer counts
        (chat_prompt.template_kwargs), off the event loop."""
        found = {name: obj[name] for name in _TEMPLATE_OPTIONS if name in obj}
        return found or None

    def read_request(self, obj: dict[str, Any]) -> RequestInfo:
        """With `echo`, vLLM opens a stream (after the role chunks) with the prompt's last
        message given back as `delta.content`, one chunk per choice (`echo_text`). Those
        chunks are no output: `echo_events` says how many may come, `echo_text` what
        each says."""
        info = super().read_request(obj)
        echo = obj.get("echo")
        if echo is None or not info.stream or lax_bool(echo) is not True:
            return info
        text = echo_text(obj)
        if text is None:
            return info
        n = lax_int(obj.get("n"))
        return replace(info, echo_events=n if n is not None and n > 0 else 1, echo_text=text)

    def _content(self, choice: dict[str, Any], texts: list[str] | None) -> str | None:
        delta = choice.get("delta")
        if not delta or type(delta) is not dict:
            return None
        if texts is None and delta.get("content"):
            return "text"  # the kind; what else the delta holds is for `beside`
        return generated(delta, texts)

    def _held(self, choice: dict[str, Any]) -> bool:
        """vLLM streams a chunk for every engine output of a choice: an empty text
        (`"content": ""`, `"reasoning": ""`) while the detokenizer holds a token's text
        back (incomplete UTF-8, a stop string's possible start) or for an EOS, and `{}`
        where a parser gave no delta, sent only on a finish or with the step's logprobs
        or token ids (chat_completion/serving.py, chat_completion_stream_generator: the
        delta's text is `output.text`; `if delta_message is None: ... continue`).
        Not held: the role chunk; `{}` alone (a keep-alive); and another backend's finish
        in a chunk of its own (OpenAI's and llama-server's `delta: {}`), which is no
        token: vLLM's finish always carries `stop_reason`, passed explicitly (`stop_reason=
        output.stop_reason`, written even when null: tests/fixtures/streams/vllm-0.32-held)."""
        delta = choice.get("delta")
        if type(delta) is not dict or "role" in delta:
            return False
        if choice.get("finish_reason") is not None:
            return "stop_reason" in choice
        if "" in delta.values():
            return True
        return choice.get("logprobs") is not None or type(choice.get("token_ids")) is list

    def _held_as(self, choice: dict[str, Any]) -> Facts | None:
        """A held output whose delta is `"reasoning": ""` is a reasoning token
        (HELD_REASONING): the parser was still in the reasoning, the token's bytes held
        back (deepseek_r1's extract_reasoning_streaming gives `reasoning=delta_text`, and
        `output.text` is empty while the detokenizer holds them). Its finish may only be
        `length` (a token cut by the limit); any other finish rides on the EOS, which is
        output and no reasoning."""
        if not self._held(choice):
            return None
        delta = choice["delta"]  # a dict: `_held` said so
        if delta.get("reasoning") == "" or delta.get("reasoning_content") == "":
            finish = choice.get("finish_reason")
            if finish is None or finish == "length":
                return HELD_REASONING
        return HELD


#: The content parts vLLM takes as text, and the field that holds it (renderers/
#: chat_utils.py: TEXT_PART_TYPES and MM_PARSER_MAP; `tool_reference` gives its name).
_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
    "tool_reference": "name",
}


def echo_text(obj: dict[str, Any]) -> str | None:
    """The text vLLM's `echo` streams back for a chat request, or None where it sends none:
    the last message's content as rendered (`message_text`), when its role is the
    answer's (`get_chat_request_role`: the last message's own role without
    add_generation_prompt, else "assistant") and that text is not empty
    (chat_completion/serving.py, chat_completion_stream_generator, `if request.echo`)."""
    messages = obj.get("messages")
    last = messages[-1] if type(messages) is list and messages else None
    if type(last) is not dict:
        return None
    generation_prompt = lax_bool(obj.get("add_generation_prompt", True)) is not False
    if generation_prompt and last.get("role") != "assistant":
        return None  # vLLM's --response-role, assistant unless set otherwise
    return message_text(last.get("content")) or None


def message_text(content: Any) -> str | None:
    """A message's content as vLLM renders it for a template that takes text
    (renderers/chat_utils.py, _parse_chat_message_content_parts): a string as it is, a
    list of parts as their texts, empty and missing ones dropped, joined with "\\n"; None
    for what holds more than text (an image's placeholder is the template's, unknown
    here)."""
    if content is None or type(content) is str:
        return content
    if type(content) is not list:
        return None
    texts = []
    for part in content:
        if type(part) is dict:
            kind = part.get("type")
            field = _TEXT_PARTS.get(kind) if type(kind) is str else None
            if field is None or part.get("uuid") is not None:
                return None  # media (with a uuid, vLLM reads any part as media)
            part = part.get(field)
        if part is None:
            continue  # vLLM skips a text part without its text
        if type(part) is not str:
            return None
        if part:
            texts.append(part)
    return "\n".join(texts)


def generated(message: dict[str, Any], texts: list[str] | None) -> str | None:
    """The kind of what a chat delta (or a whole message) generated, its texts added to
    `texts` when given: the answer, the reasoning (once, under either of vLLM's names) and
    the tool calls' names and arguments, all of which vLLM counts as completion tokens."""
    kind = None
    reasoned = False
    for key, name in _DELTA_KEYS:
        value = message.get(key)
        if value:
            if name == "reasoning":
                if reasoned:  # one text under both names (vLLM's old and new): once
                    continue
                reasoned = True
            if kind is None or kind == "reasoning":  # an answer outranks its reasoning
                kind = name
            if texts is not None:
                add_texts(texts, value)
    return kind


def call_pieces(delta: object, choice: int = 0) -> tuple[CallPiece, ...] | None:
    """The tool-call pieces of a chat delta: vLLM's tool parsers (e.g.
    vllm/tool_parsers/hermes_tool_parser.py) stream `delta.tool_calls[i]` with `index`,
    then `id` and `function.name` on the call's first delta, `function.arguments` in
    pieces on the later ones."""
    calls = delta.get("tool_calls") if type(delta) is dict else None
    if type(calls) is not list:
        return None
    pieces = []
    for call in calls:
        if type(call) is not dict:
            continue
        index = call.get("index", 0)
        function = call.get("function")
        arguments = function.get("arguments") if type(function) is dict else None
        name = function.get("name") if type(function) is dict else None
        pieces.append(
            CallPiece(
                index if type(index) is int else 0,
                bool(call.get("id") or name),
                arguments if type(arguments) is str else "",
                choice=choice,
            )
        )
    return tuple(pieces) or None


#: A run of digits that may be an integer orjson cannot keep (2**64 has 20 digits).
_LONG_NUMBER = re.compile(rb"[0-9]{20,}")


def _readable(options: dict[str, Any]) -> bool:
    """Both flags of a stream_options absent, null or a bool as pydantic reads one."""
    return all(
        options.get(flag) is None or lax_bool(options[flag]) is not None
        for flag in ("include_usage", "continuous_usage_stats")
    )


def added_field(body: bytes, field: bytes) -> bytes:
    """A JSON object's bytes with one more member, written before its closing brace: the
    client's bytes otherwise as they came (its numbers, spacing, key order and escapes).
    The object has members already (a streamed request says `stream`)."""
    end = body.rstrip().rfind(b"}")
    return body[:end] + b"," + field + body[end:]


def whole(facts: Facts, message: dict[str, Any], choice: int) -> None:
    """A whole answer's reasoning and tool calls onto a body's facts: the reasoning text
    (for a tokenizer to count, as a stream's) and each call whole, to be judged as a
    stream's calls are (vLLM's non-streaming chat puts both in `choices[i].message`)."""
    value = message.get("reasoning") or message.get("reasoning_content")
    if value and type(value) is str:
        if facts.reasoning is None:
            facts.reasoning = []
        facts.reasoning.append(value)
    calls = message.get("tool_calls")
    if calls and type(calls) is list:
        pieces = list(facts.calls or ())
        for i, call in enumerate(calls):
            if type(call) is not dict:  # no call, as a stream's call_pieces reads it
                continue
            function = call.get("function")
            arguments = function.get("arguments") if type(function) is dict else None
            text = arguments if type(arguments) is str else ""
            pieces.append(CallPiece(i, True, text, closes=True, choice=choice))
        facts.calls = tuple(pieces) or None


def beside(delta: dict[str, Any], kind: str, choice: int = 0) -> Beside:
    """What a delta of several keys carries beside its content of `kind`: (reasoning
    pieces, tool-call pieces beside an answer), each None when none.

    A delta holds several kinds when one engine step's text crossed a boundary, or when
    vLLM's API server merged two steps' outputs (v1's RequestOutputCollector): the
    deepseek_r1 reasoning parser returns reasoning and content together when `</think>`
    falls inside the delta (vllm/reasoning/deepseek_r1_reasoning_parser.py), the hermes
    tool parser content and tool_calls when text and a call's name arrive together
    (vllm/tool_parsers/hermes_tool_parser.py, extract_tool_calls_streaming). Releases that
    send the reasoning under both names send one text: it is taken once."""
    reasoning = None
    if kind != "reasoning":
        value = delta.get("reasoning") or delta.get("reasoning_content")
        if value and type(value) is str:
            reasoning = [value]
    calls = call_pieces(delta, choice) if kind == "text" else None
    if reasoning is None and calls is None:
        return _NOTHING_BESIDE
    return reasoning, calls


def keep(facts: Facts, value: object) -> None:
    """Keep generated text on `facts`, for a tokenizer to count."""
    if facts.texts is None:
        facts.texts = []
    add_texts(facts.texts, value)


def add_texts(texts: list[str], value: object) -> None:
    if type(value) is str:
        texts.append(value)
    elif type(value) is list:  # tool_calls: count the function names and arguments
        for call in value:
            function = call.get("function") if type(call) is dict else None
            if type(function) is dict:
                texts.extend(
                    v for v in (function.get("name"), function.get("arguments")) if type(v) is str
                )
