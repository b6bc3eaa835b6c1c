"""Anthropic Messages, `POST /v1/messages`, as vLLM serves it (and Anthropic defines it).

Wire facts (vllm-project/vllm: vllm/entrypoints/anthropic/serving.py, protocol.py): each
event is `event: <type>` plus `data: {"type": "<type>", ...}`, so the `type` inside the
data is enough. The order is `message_start` (message.id, model, usage.input_tokens,
output_tokens 0), per block `content_block_start`, `content_block_delta`s,
`content_block_stop`, then `message_delta` (delta.stop_reason, usage.output_tokens),
`message_stop`; Anthropic also sends `ping`. Deltas carry `text_delta.text`,
`thinking_delta.thinking`, `input_json_delta.partial_json` or `signature_delta` (not
content). An error inside the stream is `{"type": "error", "error": {"type", "message"}}`.
vLLM maps its finish reasons stop/length/tool_calls to end_turn/max_tokens/tool_use.
Usage: Anthropic's `input_tokens` excludes cache reads and cache writes
(`cache_read_input_tokens`, `cache_creation_input_tokens`); the prompt is their sum. vLLM
0.32 fills both from chat's prompt_tokens_details (--enable-prompt-tokens-details) on
message_delta and the whole answer, with `input_tokens` = prompt_tokens less both
(anthropic/serving.py, _build_anthropic_usage); its message_start says the whole prompt
as `input_tokens` and neither (the first chat chunk's usage has no details).
"""

from __future__ import annotations

from typing import Any

from proxy.core.apis.base import (
    MALFORMED,
    NOTHING,
    Api,
    Facts,
    PromptCounts,
    RequestInfo,
    TokenCounts,
    as_int,
    identity,
    json_object,
    json_text,
    request_info,
    sampling_options,
)
from proxy.core.apis.chat import keep
from proxy.core.chat_prompt import BILLING_HEADER, template_tools
from proxy.core.measurement import TokenSource
from proxy.core.toolcalls import CallPiece

#: stop_reason -> finish_reason label (anything else: "other").
STOP_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    # the answer stopped because the context window was full: cut off, as by max_tokens
    # (a stop reason of Anthropic's API since anthropic-sdk-python 0.119.0, 2026-07-23)
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}
_DELTA_CONTENT = {"text_delta": ("text", "text"), "thinking_delta": ("thinking", "reasoning"),
                  "input_json_delta": ("partial_json", "tool")}  # fmt: skip


class Messages(Api):
    endpoint = "/v1/messages"
    bench_name = "messages"
    takes_messages = True
    paths = ("/v1/messages",)
    operation = "chat"
    provider = "anthropic"
    error_shape = "anthropic"
    end_marker = "message_stop"
    measures = (
        "TTFT at the first content_block_delta with non-empty text, thinking or "
        "partial_json, or a tool_use content_block_start (its name: not message_start, a "
        "text or thinking block's start, or ping); the first answer at the first text_delta; "
        "TPOT, ITL, decode speed; tokens from message_start and message_delta usage (cache "
        "reads as cached); stop_reason; error events; a clean end at message_stop"
    )

    def bench_body(
        self, model: str, prompt: Any, max_tokens: int, ignore_eos: bool
    ) -> dict[str, Any]:
        # Messages streams always carry usage.
        return {
            "model": model,
            "messages": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }

    def template(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """The tools, as vLLM gives them to the template (anthropic/serving.py converts
        each {name, description, input_schema} to an OpenAI function)."""
        return template_tools(obj.get("tools"), "input_schema")

    def read_request(self, obj: dict[str, Any]) -> RequestInfo:
        """Anthropic's names: `stop_sequences`, top_p and top_k as chat's, no seed, n,
        penalties or response format (vllm/entrypoints/anthropic/protocol.py,
        AnthropicMessagesRequest); `system`, the instructions apart from the messages."""
        system = obj.get("system")
        options = sampling_options(
            obj, output=None, stop="stop_sequences", choices=False, seed=False, penalties=False
        )
        return request_info(
            self, obj, options, system if system and isinstance(system, str | list) else None
        )

    def prompt(self, obj: dict[str, Any]) -> Any:
        """The messages, with `system` as the first: a text, or a list of text blocks (the
        form an agent that sets `cache_control` sends; anthropic-sdk-python
        MessageCreateParams: `system: Union[str, Iterable[TextBlockParam]]`), as vLLM makes
        it a system message (anthropic/serving.py, _convert_system_message): a text as it
        is; the blocks' texts joined with nothing between, leaving out those that are no
        text, are empty, or open with Claude Code's billing header (its first block, whose
        `cch` is new each request: vLLM drops the whole block); none left, no system
        message. The chat stage then drops the billing line of a text that opens with it
        (a `system` string, here kept whole; chat_prompt.without_billing_line, which the
        digests and the count run on every system message)."""
        messages = obj.get("messages")
        system = obj.get("system")
        if isinstance(system, list):
            texts = [
                b.get("text") for b in system if isinstance(b, dict) and b.get("type") == "text"
            ]
            system = "".join(
                t for t in texts if isinstance(t, str) and not t.startswith(BILLING_HEADER)
            )
        if system and isinstance(system, str) and isinstance(messages, list):
            return [{"role": "system", "content": system}, *messages]
        return messages

    def event(self, payload: bytes, collect: bool, identify: bool) -> Facts:
        obj = json_object(payload)
        if obj is None:
            # vLLM's converter has sent an OpenAI `data: [DONE]` after its error events
            # (vllm/entrypoints/anthropic/serving.py @ 82df3f49): no event, nor a malformed one
            return NOTHING if payload == b"[DONE]" else MALFORMED
        kind = obj.get("type")
        if kind == "content_block_delta":
            delta = obj.get("delta")
            if type(delta) is not dict:
                return NOTHING
            try:
                field = _DELTA_CONTENT.get(delta.get("type"))  # type: ignore[arg-type]
            except TypeError:  # a delta `type` that is an object or a list: no delta of ours
                return NOTHING
            if field is None:
                return NOTHING
            value = delta.get(field[0])
            if not value or type(value) is not str:
                return NOTHING
            facts = Facts(content=field[1])
            if field[1] == "tool":  # only tool-call streams pay for this
                facts.calls = (CallPiece(_index(obj), False, value),)
            if collect:
                keep(facts, value)
            return facts
        if kind == "content_block_start":
            block = obj.get("content_block")
            if type(block) is dict and block.get("type") == "tool_use":
                # The call's first delta: its id and name (Anthropic's streaming docs).
                return Facts(content="tool", calls=(CallPiece(_index(obj), True, ""),))
            return NOTHING
        if kind == "content_block_stop":
            return Facts(calls=(CallPiece(_index(obj), False, "", closes=True),))
        if kind == "message_start":
            message = obj.get("message")
            if type(message) is not dict:
                return NOTHING
            usage = message.get("usage")
            if type(usage) is dict:
                # Its output_tokens is a placeholder (vLLM sends 0): only message_delta's
                # counts the output, so a stream cut before it falls back to other counts.
                usage = {k: v for k, v in usage.items() if k != "output_tokens"}
            return Facts(usage=usage if type(usage) is dict else None, **identity(message))
        if kind == "message_delta":
            delta, usage = obj.get("delta"), obj.get("usage")
            reason = delta.get("stop_reason") if type(delta) is dict else None
            return Facts(
                finish=reason if type(reason) is str else None,
                usage=usage if type(usage) is dict else None,
            )
        if kind == "message_stop":
            return Facts(end=True)
        if kind == "error":
            return Facts(error=obj)
        if type(kind) is str and kind.endswith("_error") and "message" in obj:
            # llama-server writes an `event: error` whose data is its bare error object,
            # {"code": 500, "message": ..., "type": "server_error"} (tools/server, the
            # streaming lambda: format_anthropic_sse({{"event", "error"}, {"data", res_json}}))
            return Facts(error=obj)
        return NOTHING  # ping, signature deltas, future events

    def body(self, obj: dict[str, Any], collect: bool) -> Facts:
        facts = super().body(obj, collect)
        reason = obj.get("stop_reason")
        if type(reason) is str:
            facts.finish = reason
        content = obj.get("content")
        if type(content) is list:
            _whole(facts, content)
            if collect:
                for block in content:
                    if type(block) is dict:
                        text = block.get("text", block.get("thinking"))
                        if type(text) is str:
                            keep(facts, text)
        return facts

    def answered(self, obj: dict[str, Any]) -> bool:
        """A `text` block with text (the reasoning is a `thinking` block of its own)."""
        content = obj.get("content")
        return any(
            type(block) is dict and block.get("type") == "text" and bool(block.get("text"))
            for block in (content if type(content) is list else ())
        )

    def finish_label(self, raw: str) -> str:
        return STOP_REASONS.get(raw, "other")

    def merge_usage(self, old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
        # message_start has the input side, message_delta the (cumulative) output side;
        # field by field, and a null in the later one never erases a count seen earlier.
        return {**old, **{k: v for k, v in new.items() if v is not None}}

    def counts(self, usage: dict[str, Any]) -> TokenCounts | None:
        output = as_int(usage.get("output_tokens"))
        if output is None:
            return None
        prompt, read, written = self.prompt_counts(usage)
        return TokenCounts(prompt, output, read, TokenSource.USAGE, written)

    def prompt_counts(self, usage: dict[str, Any]) -> PromptCounts:
        # message_start's usage has them before any output (its output_tokens is dropped)
        parts = [as_int(usage.get(k)) for k in _PROMPT_PARTS]
        return None if parts[0] is None else sum(p or 0 for p in parts), parts[1], parts[2]


def _whole(facts: Facts, content: list[Any]) -> None:
    """A whole answer's thinking (for a tokenizer to count) and each `tool_use` as a whole
    call, judged as a stream's are: vLLM's non-streaming Messages answer puts the chat
    answer's reasoning in a `thinking` block and each call in a `tool_use` block whose
    `input` is the arguments parsed (anthropic/serving.py, messages_full_converter)."""
    calls = []
    for index, block in enumerate(content):
        if type(block) is not dict:
            continue
        kind = block.get("type")
        if kind == "thinking":
            thinking = block.get("thinking")
            if thinking and type(thinking) is str:
                facts.reasoning = [*(facts.reasoning or ()), thinking]
        elif kind == "tool_use":
            given = block.get("input")
            arguments = json_text(given) if type(given) is dict else ""
            calls.append(CallPiece(index, True, arguments, closes=True))
    if calls:
        facts.calls = tuple(calls)


def _index(obj: dict[str, Any]) -> int:
    index = obj.get("index", 0)
    return index if type(index) is int else 0


_PROMPT_PARTS = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
