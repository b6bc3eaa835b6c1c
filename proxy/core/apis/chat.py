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

from typing import Any, ClassVar

import orjson

from proxy.core.apis.base import END, MALFORMED, Api, Facts, identity

_DELTA_KEYS = (
    ("content", "text"),
    ("reasoning_content", "reasoning"),
    ("reasoning", "reasoning"),
    ("tool_calls", "tool"),
)


class OpenAIGeneration(Api):
    """What chat and text completions share: the `choices` stream, usage, [DONE]."""

    finish_ends_stream: ClassVar[bool] = True
    end_marker: ClassVar[str] = "[DONE] or finish_reason"

    def usage_requested(self, obj: dict[str, Any]) -> bool:
        options = obj.get("stream_options")
        return isinstance(options, dict) and options.get("include_usage") is True

    def max_tokens(self, obj: dict[str, Any]) -> object:
        return obj.get("max_completion_tokens", obj.get("max_tokens"))

    def ask_for_usage(self, obj: dict[str, Any]) -> bytes | None:
        """The body re-encoded with `stream_options.include_usage: true`."""
        options = obj.get("stream_options")
        merged = dict(options) if isinstance(options, dict) else {}
        merged["include_usage"] = True
        return orjson.dumps({**obj, "stream_options": merged})

    def event(self, payload: bytes, collect: bool, identify: bool) -> Facts:
        if payload == b"[DONE]":
            return END
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return MALFORMED
        if type(obj) is not dict:
            return MALFORMED
        facts = Facts(**identity(obj)) if identify else Facts()
        choices = obj.get("choices")
        if choices and type(choices) is list:
            self._choices(choices, facts, collect)
        usage = obj.get("usage")
        if usage and type(usage) is dict:
            facts.usage = usage
        error = obj.get("error")
        if error is not None:
            facts.error = error
        return facts

    def _choices(self, choices: list[Any], facts: Facts, collect: bool) -> None:
        with_content: list[int] | None = None
        for choice in choices:
            if type(choice) is not dict:
                continue
            kind = self._content(choice, facts, collect)
            if kind is not None:
                facts.content = kind
                index = choice.get("index", 0)
                index = index if type(index) is int else 0
                if with_content is None:
                    with_content = [index]
                else:
                    with_content.append(index)
            reason = choice.get("finish_reason")
            if reason and type(reason) is str:
                facts.finish = reason
        if with_content is not None and with_content != [0]:
            facts.choices = tuple(with_content)

    def _content(self, choice: dict[str, Any], facts: Facts, collect: bool) -> str | None:
        raise NotImplementedError

    def body(self, obj: dict[str, Any], collect: bool) -> Facts:
        facts = super().body(obj, collect)
        choices = obj.get("choices")
        if type(choices) is list:
            for choice in choices:
                if type(choice) is not dict:
                    continue
                reason = choice.get("finish_reason")
                if reason and type(reason) is str:
                    facts.finish = reason
                if collect:
                    message = choice.get("message")
                    text = message.get("content") if type(message) is dict else choice.get("text")
                    if type(text) is str:
                        keep_text(facts, text)
        return facts


class Chat(OpenAIGeneration):
    endpoint = "/v1/chat/completions"
    paths = ("/v1/chat/completions",)
    operation = "chat"
    measures = (
        "TTFT at the first chunk with non-empty delta content, reasoning or tool_calls "
        "(not the role-only first chunk); TPOT, ITL, decode speed, tokens from usage "
        "(asked for when the client did not), finish_reason, in-stream errors"
    )

    def prompt(self, obj: dict[str, Any]) -> Any:
        return obj.get("messages")

    def _content(self, choice: dict[str, Any], facts: Facts, collect: bool) -> str | None:
        delta = choice.get("delta")
        if not delta or type(delta) is not dict:
            return None
        kind = None
        for key, name in _DELTA_KEYS:
            value = delta.get(key)
            if value:
                kind = name
                if collect:
                    keep_text(facts, value)
        return kind


def keep_text(facts: Facts, value: object) -> None:
    texts = facts.texts
    if texts is None:
        texts = facts.texts = []
    if type(value) is str:
        texts.append(value)
    elif type(value) is list:  # tool_calls: count the function names and arguments
        for call in value:
            function = call.get("function") if type(call) is dict else None
            if type(function) is dict:
                texts.extend(
                    v for v in (function.get("name"), function.get("arguments")) if type(v) is str
                )
