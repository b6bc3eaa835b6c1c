"""Anthropic Messages (`POST /v1/messages`) as vLLM's Anthropic layer puts it on the wire.

Source: vllm-project/vllm, vllm/entrypoints/anthropic/serving.py (message_stream_converter,
messages_full_converter), protocol.py (AnthropicStreamEvent, AnthropicUsage, ...) and
api_router.py (error translation). vLLM runs the request as a chat completion with
`continuous_usage_stats` and converts each chat chunk; events are serialized with
pydantic `model_dump_json(exclude_unset=True)`, so only the fields it sets appear, in
the model's field order (event: type, message, delta, content_block, index, error,
usage), and every event is `event: <type>\\ndata: <json>\\n\\n`:

  message_start        from the role chunk, so with the first engine output (the first
                       token, an empty answer's EOS; proxy/sim/events.py first_output;
                       t~0 under x-sim-early-role): message {id, type: "message", role:
                       "assistant", content: [], model, stop_reason: null,
                       stop_sequence: null, usage {input_tokens, output_tokens: 0}}
                       (vLLM 0.32 sets type and role: its captured messages_stream.sse)
  content_block_start  lazily, just before the first text delta:
                       {"type":"text","text":""} at index 0
  content_block_delta  {"type":"text_delta","text":...} per chunk
  content_block_stop   then message_delta {delta {stop_reason, stop_sequence}, usage
                       {input_tokens, output_tokens}} from the usage chunk, then
                       message_stop ([DONE])

Usage is _build_anthropic_usage (anthropic/serving.py) of a chat chunk's usage:
message_start's from the first chunk's continuous usage, which has no
prompt_tokens_details, so {input_tokens: the whole prompt, output_tokens: 0}; message_delta's
and the whole answer's from the final usage, whose details (--enable-prompt-tokens-details:
here, cached tokens programmed) add `cache_creation_input_tokens` (chat's
created_cache_tokens, proxy/sim/wire.py cache_writes) and `cache_read_input_tokens`
(cached_tokens), each taken off `input_tokens` ("Anthropic defines total_input ==
input_tokens + cache_read + cache_creation"), in AnthropicUsage's field order (input,
output, cache_creation, cache_read).

stop_reason (vLLM 0.32's _to_anthropic_stop_reason): finish_reason length -> max_tokens;
stop (or tool_calls) with the matched stop string in the chat choice's `stop_reason` ->
stop_sequence, with `stop_sequence` that string (null otherwise: set explicitly, so the
stream always sends it); stop -> end_turn, tool_calls -> tool_use, anything else -> null.
An `x-sim-finish-reason` that is already an Anthropic stop reason (e.g. stop_sequence,
refusal) is sent as it is.

stop_sequences go to chat as `stop` (serving.py _build_base_request), so the text is cut
as chat cuts it (proxy/sim/stops.py: before the string, held back while one may still
match, the tokens up to the one completing it counted, no EOS). The converter skips a chat
chunk whose content is "" (message_stream_converter: `if ... content == "": pass`), so a
step whose text is all held back sends no event, and the block opens with the first text
that is sent; an answer the stop cut to nothing opens no block.

Non-streamed: `model_dump(exclude_none=True)` of {id, type: "message", role:
"assistant", content: [{"type":"text","text"}], model, stop_reason, stop_sequence (where
set), usage}; an empty text is still one empty text block (messages_full_converter:
"Anthropic's canonical shape for an empty completion is a single empty text block").

Errors: vLLM's OpenAI-style ErrorResponse rebuilt as {"type":"error","error":{"type":
<vLLM's type, e.g. "BadRequestError">, "message"}} with the same status. In a stream a
failure is `event: error` with {"type":"error","error":{"type":"internal_error",...}}
and the body ends (no message_stop); its message is pydantic's text for chat's error
chunk, which the converter fails to read as a chat chunk (MessagesWire.error).

With `stamp`, each text delta starts with `"sent_ns":<time.time_ns()>`, as chat chunks do.

Not vLLM: `x-sim-ping: 1` adds Anthropic's `event: ping` right after message_start, in
the same write.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from proxy.sim import wire
from proxy.sim.controls import Plan
from proxy.sim.tokens import completion_text
from proxy.sim.wire import stamp_text

#: vLLM's stop_reason_map (finish_reason -> Anthropic stop_reason).
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
#: Anthropic's own stop reasons, passed through when forced with x-sim-finish-reason.
ANTHROPIC_STOP_REASONS = frozenset(
    {"end_turn", "max_tokens", "stop_sequence", "tool_use", "pause_turn", "refusal"}
)

PING = b'event: ping\ndata: {"type":"ping"}\n\n'


def stop_reason(finish_reason: str, stop_string: str | None = None) -> str | None:
    """serving.py _to_anthropic_stop_reason for an answer without tool_use blocks;
    `stop_string` is the stop string that ended it, if one did."""
    if finish_reason in ANTHROPIC_STOP_REASONS:
        return finish_reason
    if finish_reason in ("stop", "tool_calls") and stop_string is not None:
        return "stop_sequence"
    return STOP_REASONS.get(finish_reason)


def _event(name: bytes, data: bytes) -> bytes:
    return b"event: " + name + b"\ndata: " + data + b"\n\n"


class MessagesWire:
    """The events (or the body) of one Messages response."""

    __slots__ = ("_id", "_model", "_plan", "_pre", "_stamp", "finish_reason", "stop_sequence")

    def __init__(self, plan: Plan, response_id: str, stamp: str = "") -> None:
        self._stamp = stamp
        self._plan = plan
        self._id = orjson.dumps(response_id)
        self._model = orjson.dumps(plan.model)
        hit = plan.stop_hit
        self.finish_reason = stop_reason(plan.finish_reason, None if hit is None else hit.string)
        matched = self.finish_reason == "stop_sequence"
        self.stop_sequence = hit.string if hit is not None and matched else None
        self._pre = (
            b'event: content_block_delta\ndata: {"type":"content_block_delta",'
            b'"delta":{"type":"text_delta","text":"'
        )

    def usage(self, output_tokens: int) -> bytes:
        """The final usage (message_delta, the whole answer): with the details, the cache
        writes and reads apart from `input_tokens` (the module's docstring)."""
        plan = self._plan
        cached = plan.cached_tokens
        if cached is None:
            return b'{"input_tokens":%d,"output_tokens":%d}' % (plan.prompt_tokens, output_tokens)
        written = wire.cache_writes(plan.prompt_tokens, cached, plan.cache_block)
        return (
            b'{"input_tokens":%d,"output_tokens":%d,"cache_creation_input_tokens":%d,'
            b'"cache_read_input_tokens":%d}'
            % (max(0, plan.prompt_tokens - cached - written), output_tokens, written, cached)
        )

    def start_usage(self) -> bytes:
        """message_start's usage: the first chat chunk's, without details."""
        return b'{"input_tokens":%d,"output_tokens":0}' % self._plan.prompt_tokens

    def opening(self) -> list[bytes]:
        return []  # message_start waits for the first engine output (first_output)

    def first_output(self) -> list[bytes]:
        message = (
            b'{"id":%s,"type":"message","role":"assistant","content":[],"model":%s,'
            b'"stop_reason":null,"stop_sequence":null,"usage":%s}'
            % (self._id, self._model, self.start_usage())
        )
        start = _event(b"message_start", b'{"type":"message_start","message":%s}' % message)
        return [start, PING] if self._plan.ping else [start]

    def block_start(self) -> list[bytes]:
        return [
            _event(
                b"content_block_start",
                b'{"type":"content_block_start","content_block":{"type":"text","text":""},'
                b'"index":0}',
            )
        ]

    def content(self, text: bytes) -> bytes:
        pre = self._pre
        if self._stamp == "text":
            text = stamp_text(text)
        elif self._stamp:
            stamped = b'data: {"sent_ns":%d,"type"' % time.time_ns()
            pre = pre.replace(b'data: {"type"', stamped, 1)
        return pre + text + b'"},"index":0}\n\n'

    def closing(self, sent: int, started: bool) -> list[bytes]:
        out = []
        if started:
            out.append(_event(b"content_block_stop", b'{"type":"content_block_stop","index":0}'))
        out.append(
            _event(
                b"message_delta",
                b'{"type":"message_delta","delta":{"stop_reason":%s,"stop_sequence":%s},'
                b'"usage":%s}'
                % (
                    orjson.dumps(self.finish_reason),
                    orjson.dumps(self.stop_sequence),
                    self.usage(sent + self._plan.eos),
                ),
            )
        )
        out.append(_event(b"message_stop", b'{"type":"message_stop"}'))
        return out

    def error(self, chat_error: bytes) -> bytes:
        """`event: error`, pydantic's text for the chat error chunk as its message
        (wire.converted_error; anthropic/serving.py message_stream_converter, `except
        Exception`: AnthropicStreamEvent(type="error", error=AnthropicError(type=
        "internal_error", message=sanitize_message(str(e)))), exclude_unset)."""
        error = {"type": "internal_error", "message": wire.converted_error(chat_error)}
        return _event(b"error", orjson.dumps({"type": "error", "error": error}))

    def full(self, sent: int) -> bytes:
        hit = self._plan.stop_hit
        body: dict[str, Any] = {
            "id": orjson.Fragment(self._id),
            "type": "message",
            "role": "assistant",
            "content": [
                {"type": "text", "text": completion_text(sent) if hit is None else hit.text}
            ],
            "model": self._plan.model,
        }
        if self.finish_reason is not None:
            body["stop_reason"] = self.finish_reason
        if self.stop_sequence is not None:
            body["stop_sequence"] = self.stop_sequence
        body["usage"] = orjson.Fragment(self.usage(sent + self._plan.eos))
        return orjson.dumps(body)


def count_tokens(prompt_tokens: int) -> bytes:
    """vLLM's `/v1/messages/count_tokens` body (AnthropicCountTokensResponse)."""
    return b'{"input_tokens":%d,"context_management":{"original_input_tokens":%d}}' % (
        prompt_tokens,
        prompt_tokens,
    )
