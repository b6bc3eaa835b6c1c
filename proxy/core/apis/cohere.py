"""Cohere chat v2, `POST /cohere/v2/chat`, as vLLM serves it (`VLLM_ENABLE_COHERE_API=1`).

Wire facts (vllm-project/vllm: vllm/entrypoints/cohere/serving.py @ 02969a445a77,
`_chat_completion_stream_to_v2`, `_build_message_end_event`, `_map_finish_reason`): vLLM
runs the request as a chat completion and re-emits it as Cohere v2 events, each a bare
`data: {"type": ...}` (no `event:` line): `message-start` (id, delta.message.role), per
block `content-start`, `content-delta`s (`delta.message.content.text`, or `.thinking` for
a reasoning block), `content-end`; `tool-plan-delta` (`delta.message.tool_plan`),
`tool-call-start` / `tool-call-delta` (`delta.message.tool_calls.function.arguments`) /
`tool-call-end`, `citation-start` / `citation-end`; then `message-end` with
`delta.finish_reason` (COMPLETE, STOP_SEQUENCE, MAX_TOKENS, TOOL_CALL, ERROR) and
`delta.usage` (`billed_units` and `tokens`, each input_tokens/output_tokens, and
`cached_tokens`), then `data: [DONE]`. A failure while converting ends with a
`message-end` whose delta carries `error` and finish_reason ERROR.
"""

from __future__ import annotations

from typing import Any

from proxy.core.apis.base import (
    END,
    MALFORMED,
    NOTHING,
    Api,
    Facts,
    RequestInfo,
    RequestOptions,
    TokenCounts,
    as_int,
    finite_float,
    json_object,
    output_type,
    request_info,
    stop_sequences,
)
from proxy.core.apis.chat import keep
from proxy.core.lax import lax_int
from proxy.core.measurement import TokenSource
from proxy.core.toolcalls import CallPiece

#: Cohere's finish_reason -> the closed label set (anything else: "other").
FINISH = {
    "COMPLETE": "stop",
    "STOP_SEQUENCE": "stop",
    "MAX_TOKENS": "length",
    "TOOL_CALL": "tool_calls",
    "ERROR": "error",
}
#: The request fields `read_request` takes the sampling and output options from.
_OPTIONS = frozenset(
    {"seed", "p", "k", "frequency_penalty", "presence_penalty", "stop_sequences",
     "response_format"}
)  # fmt: skip


class CohereChat(Api):
    endpoint = "/cohere/v2/chat"
    bench_name = "cohere"
    takes_messages = True
    paths = ("/cohere/v2/chat",)
    operation = "chat"
    provider = "cohere"
    end_marker = "message-end"
    measures = (
        "TTFT at the first content-delta with non-empty text or thinking, tool-plan-delta, "
        "tool-call-start or tool-call-delta arguments (not message-start or content-start); "
        "the first answer at the first text content-delta; TPOT, ITL, "
        "decode speed; tokens and finish_reason from message-end (usage.tokens, cached_tokens); "
        "a message-end carrying an error"
    )

    def read_request(self, obj: dict[str, Any]) -> RequestInfo:
        """Cohere's names: `p` and `k` for top_p and top_k, `stop_sequences`; seed, the
        penalties, `response_format`, temperature and max_tokens as chat's; no `n`
        (docs.cohere.com/reference/chat; vLLM's CohereChatV2Request in
        vllm/entrypoints/cohere/protocol.py, which _build_base_chat_completion in serving.py
        maps onto chat's top_p=p, top_k=k, stop=stop_sequences)."""
        return request_info(self, obj, _options(obj))

    def prompt(self, obj: dict[str, Any]) -> Any:
        return obj.get("messages")

    def bench_body(
        self, model: str, prompt: Any, max_tokens: int, ignore_eos: bool
    ) -> dict[str, Any]:
        # Usage always comes with message-end.
        return {
            "model": model,
            "messages": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }

    def event(self, payload: bytes, collect: bool, identify: bool) -> Facts:
        if payload == b"[DONE]":
            return END
        obj = json_object(payload)
        if obj is None:
            return MALFORMED
        kind = obj.get("type")
        if kind == "content-delta" or kind == "tool-plan-delta" or kind == "tool-call-delta":
            value, content = _delta(obj, kind)
            if not value or type(value) is not str:
                return NOTHING
            facts = Facts(content=content)
            if kind == "tool-call-delta":  # only tool-call streams pay for this
                facts.calls = (CallPiece(_index(obj), False, value),)
            if collect:
                keep(facts, value)
            return facts
        if kind == "tool-call-start":
            value, _ = _delta(obj, "tool-call-delta")
            piece = CallPiece(_index(obj), True, value if type(value) is str else "")
            return Facts(content="tool", calls=(piece,))
        if kind == "tool-call-end":
            return Facts(calls=(CallPiece(_index(obj), False, "", closes=True),))
        if kind == "message-start":
            rid = obj.get("id")
            return Facts(response_id=rid if type(rid) is str else "") if identify else NOTHING
        if kind == "message-end":
            delta = obj.get("delta")
            if type(delta) is not dict:
                return Facts(end=True)
            reason, usage, error = (
                delta.get("finish_reason"),
                delta.get("usage"),
                delta.get("error"),
            )
            return Facts(
                finish=reason if type(reason) is str else None,
                usage=usage if type(usage) is dict else None,
                error={"message": error} if error else None,
                end=True,
            )
        return NOTHING

    def body(self, obj: dict[str, Any], collect: bool) -> Facts:
        usage, reason = obj.get("usage"), obj.get("finish_reason")
        rid = obj.get("id")
        facts = Facts(
            usage=usage if type(usage) is dict else None,
            finish=reason if type(reason) is str else None,
            response_id=rid if type(rid) is str else "",
        )
        message = obj.get("message")
        content = message.get("content") if type(message) is dict else None
        if collect and type(content) is list:
            for block in content:
                if type(block) is dict:
                    text = block.get("text", block.get("thinking"))
                    if type(text) is str:
                        keep(facts, text)
        return facts

    def finish_label(self, raw: str) -> str:
        return FINISH.get(raw, "other")

    def counts(self, usage: dict[str, Any]) -> TokenCounts | None:
        tokens = usage.get("tokens")
        if type(tokens) is not dict:
            tokens = usage.get("billed_units")
        if type(tokens) is not dict:
            return None
        output = as_int(tokens.get("output_tokens"))
        if output is None:
            return None
        return TokenCounts(
            prompt=as_int(tokens.get("input_tokens")),
            output=output,
            cached=as_int(usage.get("cached_tokens")),
            source=TokenSource.USAGE,
        )


def _options(obj: dict[str, Any]) -> RequestOptions | None:
    """The options a request names, as `sampling_options` reads chat's; None when it names
    none (most requests: one pass over its keys)."""
    if _OPTIONS.isdisjoint(obj):
        return None
    get = obj.get
    return RequestOptions(
        seed=lax_int(get("seed")),
        top_p=finite_float(get("p")),
        top_k=lax_int(get("k")),
        frequency_penalty=finite_float(get("frequency_penalty")),
        presence_penalty=finite_float(get("presence_penalty")),
        stop_sequences=stop_sequences(get("stop_sequences")),
        output_type=output_type(get("response_format")),
    )


def _index(obj: dict[str, Any]) -> int:
    index = obj.get("index", 0)
    return index if type(index) is int else 0


def _delta(obj: dict[str, Any], kind: str) -> tuple[object, str]:
    delta = obj.get("delta")
    message = delta.get("message") if type(delta) is dict else None
    if type(message) is not dict:
        return None, "text"
    if kind == "tool-plan-delta":
        return message.get("tool_plan"), "reasoning"
    if kind == "tool-call-delta":
        calls = message.get("tool_calls")
        function = calls.get("function") if type(calls) is dict else None
        return (function.get("arguments") if type(function) is dict else None), "tool"
    content = message.get("content")
    if type(content) is not dict:
        return None, "text"
    text = content.get("text")
    if text:
        return text, "text"
    return content.get("thinking"), "reasoning"
