"""Cohere chat v2 (`POST /cohere/v2/chat`) as vLLM's Cohere layer puts it on the wire.

Source: vllm-project/vllm vllm/entrypoints/cohere/serving.py @ 02969a445a77
(`_chat_completion_stream_to_v2`, `_handle_text_delta`, `_build_message_end_event`,
`_map_finish_reason`, `_chat_completion_to_v2`). Every event is a bare `data: <json>\\n\\n`
(`model_dump_json(exclude_none=True)`), the stream ends with `data: [DONE]`:

  message-start  from the role chunk (`if not state.started`), so with the first engine
                 output (proxy/sim/events.py first_output; t~0 under x-sim-early-role):
                 {"type","id","delta":{"message":{"role":"assistant"}}}
  content-start  just before the first text: {"type","index":0,"delta":{"message":
                 {"content":{"type":"text","text":""}}}}
  content-delta  {"type","index":0,"delta":{"message":{"content":{"text":...}}}} per chunk
  content-end    then message-end {"type","id","delta":{"finish_reason", "usage":
                 {"billed_units":{input_tokens,output_tokens},"tokens":{...}[,"cached_tokens"]}}}

finish_reason (vLLM 0.32's `_map_finish_reason`): stop with the matched stop string in the
chat choice's `stop_reason` -> STOP_SEQUENCE, else stop -> COMPLETE, length -> MAX_TOKENS,
tool_calls -> TOOL_CALL, error -> ERROR, anything else COMPLETE. A failure mid-stream is a
message-end carrying `error` (pydantic's text for chat's error chunk) and finish_reason
ERROR, in `json.dumps`'s spacing, then [DONE] (CohereWire.error). Errors before the stream
keep vLLM's OpenAI-style body.

`stop_sequences` go to chat as `stop` (`_build_base_chat_completion`), so the text is cut as
chat cuts it (proxy/sim/stops.py). The stream converter sends only non-empty text (`if
delta.content:`), so a step whose text is all held back sends no event, and content-start
comes with the first text sent. Not streamed, an empty text is no content block, and
`content=content_blocks or None` under `model_dump(exclude_none=True)` (api_router.py)
leaves the message without `content`.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from proxy.sim import wire
from proxy.sim.controls import Plan
from proxy.sim.tokens import completion_text

#: serving.py _FINISH_REASON_MAP (finish_reason -> Cohere's finish_reason).
FINISH = {
    "stop": "COMPLETE",
    "length": "MAX_TOKENS",
    "tool_calls": "TOOL_CALL",
    "stop_sequence": "STOP_SEQUENCE",
    "error": "ERROR",
}
DONE = b"data: [DONE]\n\n"


def _data(obj: bytes) -> bytes:
    return b"data: " + obj + b"\n\n"


class CohereWire:
    """The events (or the body) of one Cohere chat v2 response."""

    __slots__ = ("_id", "_plan", "finish_reason")

    def __init__(self, plan: Plan, response_id: str) -> None:
        self._plan = plan
        self._id = orjson.dumps(response_id)
        # _map_finish_reason: vLLM reports EOS and a matched stop string alike as "stop";
        # the string in stop_reason tells them apart.
        stopped = plan.finish_reason == "stop" and plan.stop_hit is not None
        self.finish_reason = (
            "STOP_SEQUENCE" if stopped else FINISH.get(plan.finish_reason, "COMPLETE")
        )

    def usage(self, output_tokens: int) -> bytes:
        plan = self._plan
        counts = b'{"input_tokens":%d,"output_tokens":%d}' % (plan.prompt_tokens, output_tokens)
        out = b'{"billed_units":%s,"tokens":%s' % (counts, counts)
        if plan.cached_tokens is not None:
            out += b',"cached_tokens":%d' % plan.cached_tokens
        return out + b"}"

    def opening(self) -> list[bytes]:
        return []  # message-start waits for the first engine output (first_output)

    def first_output(self) -> list[bytes]:
        return [
            _data(
                b'{"type":"message-start","id":%s,"delta":{"message":{"role":"assistant"}}}'
                % self._id
            )
        ]

    def block_start(self) -> list[bytes]:
        return [
            _data(
                b'{"type":"content-start","index":0,"delta":{"message":{"content":'
                b'{"type":"text","text":""}}}}'
            )
        ]

    def content(self, text: bytes) -> bytes:
        return (
            b'data: {"type":"content-delta","index":0,"delta":{"message":{"content":{"text":"'
            + text
            + b'"}}}}\n\n'
        )

    def closing(self, sent: int, started: bool) -> list[bytes]:
        out = [_data(b'{"type":"content-end","index":0}')] if started else []
        out.append(
            _data(
                b'{"type":"message-end","id":%s,"delta":{"finish_reason":"%s","usage":%s}}'
                % (self._id, self.finish_reason.encode(), self.usage(sent + self._plan.eos))
            )
        )
        out.append(DONE)
        return out

    def error(self, chat_error: bytes) -> bytes:
        """message-end with pydantic's text for the chat error chunk, no content-end
        before it, then [DONE] (cohere/serving.py _chat_completion_stream_to_v2, `except
        Exception as exc`: `json.dumps` of {"type","delta":{"error":sanitize_message(
        str(exc)),"finish_reason":"ERROR"}}, so with json's spaces; wire.converted_error)."""
        delta = {"error": wire.converted_error(chat_error), "finish_reason": "ERROR"}
        return _data(json.dumps({"type": "message-end", "delta": delta}).encode()) + DONE

    def full(self, sent: int) -> bytes:
        hit = self._plan.stop_hit
        text = completion_text(sent) if hit is None else hit.text
        message: dict[str, Any] = {"role": "assistant"}
        if text:
            message["content"] = [{"type": "text", "text": text}]
        body: dict[str, Any] = {
            "id": orjson.Fragment(self._id),
            "finish_reason": self.finish_reason,
            "message": message,
            "usage": orjson.Fragment(self.usage(sent + self._plan.eos)),
        }
        return orjson.dumps(body)
