"""OpenAI Responses (`POST /v1/responses`) as vLLM serves it (text output, no tools).

Sources: vllm-project/vllm, vllm/entrypoints/openai/responses/serving.py
(responses_stream_generator: sequence numbers from 0, one per event; response.created
and response.in_progress first, then the events of the simple path, then
response.completed built by responses_full_generator), simple_streaming_events.py (the
output-text item events), protocol.py (ResponsesResponse, ResponseUsage). The events
are the openai SDK's pydantic types, written as `event: <type>\\ndata: <json>\\n\\n`
with every field (nulls included) in the SDK's field order (openai-python,
src/openai/types/responses/*_event.py):

  response.created, response.in_progress   with the headers (t~0), status in_progress:
                                           yielded before the engine's first output
                                           is read, unlike Messages' message_start
  response.output_item.added               lazily, with the first text: the message
  response.content_part.added              item and its empty output_text part
  response.output_text.delta               one per chunk
  response.output_text.done, response.content_part.done, response.output_item.done
  response.completed                       the whole response with usage {input_tokens,
                                           input_tokens_details {cached_tokens,
                                           cache_write_tokens, input_tokens_per_turn [],
                                           cached_tokens_per_turn []}, output_tokens,
                                           output_tokens_details {reasoning_tokens,
                                           tool_output_tokens, output_tokens_per_turn [],
                                           tool_output_tokens_per_turn []}, total_tokens}
                                           (protocol.py ResponseUsage; serving.py:879-903)

Cut short by `max_output_tokens` (finish "length"), vLLM still sends
`response.completed`, with status "incomplete" and incomplete_details {"reason":
"max_output_tokens"}; `x-sim-incomplete-event: 1` sends `response.incomplete` instead,
as OpenAI's own API does. An in-stream failure is an `error` event (openai-python
ResponseErrorEvent: code, message, param, sequence_number, type) and the body ends.
The response object keeps vLLM's field order (protocol.py ResponsesResponse): the SDK's
fields, `metrics` when there are any (dumped whole, nulls included, in the stream too),
then presence_penalty, frequency_penalty (floats, from the sampling params, as temperature
and top_p) and four nulls (kv/ec_transfer_params, input/output_messages); tool_choice is
"none" without tools (ResponsesRequest.check_tool_usage). Checked key by key against the
capture tests/fixtures/streams/vllm-0.32/responses_stream.sse. With
`stamp`, each text delta starts with `"sent_ns":<time.time_ns()>`, as chat chunks do.
Item ids are vLLM's `msg_<random_uuid()>` (16 hex digits, vllm/utils/__init__.py), and a
message item ends with the SDK's `phase` (null), as vLLM 0.32 writes it (its captured
responses_stream.sse).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import orjson

from proxy.sim import errors, wire
from proxy.sim.controls import Plan
from proxy.sim.tokens import completion_text
from proxy.sim.wire import stamp_text

#: Finish reasons that make a response "incomplete", with the reason vLLM reports.
INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def _event(name: bytes, data: bytes) -> bytes:
    return b"event: " + name + b"\ndata: " + data + b"\n\n"


def random_uuid() -> str:
    """vLLM's `random_uuid` (vllm/utils/__init__.py): 16 hex digits, the ids' tail."""
    return f"{uuid.uuid4().int & 0xFFFF_FFFF_FFFF_FFFF:016x}"


def output_text(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    """An `output_text` content part (openai-python ResponseOutputText, its field order)."""
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """A message output item (ResponseOutputMessage, its field order; `phase` unset)."""
    content = [] if text is None else [output_text(text, None)]
    return {"id": item_id, "content": content, "role": "assistant", "status": status,
            "type": "message", "phase": None}  # fmt: skip


#: The statuses of a response still generating: only the final one is stored.
_OPEN = frozenset({"in_progress", "queued"})

#: ResponsesResponse's last fields, null unless disaggregated serving or
#: enable_response_messages sets them (protocol.py).
_VLLM_NULLS = ("kv_transfer_params", "ec_transfer_params", "input_messages", "output_messages")


def invalid_previous_id(body: Any) -> errors.ErrorReply | None:
    """vLLM's 400 for a `previous_response_id` that is neither a string nor null
    (protocol.py ResponsesRequest: `previous_response_id: str | None`), or None: pydantic
    refuses the body before anything else runs; checked against vLLM 0.32's validation
    handler (5 is refused as 'input': '5', a list as '<list of N items>')."""
    previous = body.get("previous_response_id") if isinstance(body, dict) else None
    if previous is None or isinstance(previous, str):
        return None
    loc = "body.previous_response_id"
    err = {"type": "string_type", "loc": loc, "msg": "Input should be a valid string"}
    return errors.validation_error(loc, [{**err, "input": errors.error_input(previous)}])


def _number(body: dict[str, Any], key: str, default: float) -> Any:
    """A sampling parameter as vLLM reports it, from its SamplingParams: a float."""
    value = body.get(key)
    if value is None:
        return default
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def tool_choice(body: dict[str, Any]) -> Any:
    """vLLM's ResponsesRequest.check_tool_usage: without tools, "auto" (the default) and
    "none" are both reported as "none"."""
    choice = body.get("tool_choice", "auto")
    if not body.get("tools") and choice in ("auto", "none"):
        return "none"
    return choice


def whole_metrics(metrics: bytes) -> bytes:
    """`metrics` as part of a whole model dump, nulls included: the response in
    `response.completed` is dumped whole, streamed or not (the capture's
    `"speculative_decoding":null`), unlike a chat usage chunk (exclude_none)."""
    obj = orjson.loads(metrics)
    spec = obj.setdefault("speculative_decoding", None)
    if isinstance(spec, dict):
        spec.setdefault("per_step_accepted", None)
        spec.setdefault("per_step_drafted", None)
    return orjson.dumps(obj)


class ResponsesWire:
    """The events (or the body) of one Responses response; numbers events as it goes."""

    def __init__(
        self,
        plan: Plan,
        body: dict[str, Any],
        response_id: str,
        created: int,
        stamp: str = "",
    ):
        self._stamp = stamp
        self._plan = plan
        self._body = body
        self._id = response_id
        self._created = created
        self._item_id = f"msg_{random_uuid()}"
        self._seq = 0
        self._incomplete = INCOMPLETE.get(plan.finish_reason)
        self.finish_reason: str | None = self._incomplete or "completed"
        item = orjson.dumps(self._item_id)
        self._pre = b'event: response.output_text.delta\ndata: {"content_index":0,"delta":"'
        self._post = b'","item_id":' + item + b',"logprobs":[],"output_index":0,"sequence_number":'
        #: vLLM 0.32's per-request `metrics` for (tokens sent, streamed), when asked for
        #: (proxy/sim/engine.py): in the response of `response.completed` and the body.
        self.metrics: Callable[[int, bool], bytes | None] | None = None
        #: Where the final response goes as it is built, before its body or its
        #: `response.completed` is sent, as vLLM stores it (serving.py:927-932); None
        #: when it is not stored (`store` false, or a background response's own store).
        self.on_final: Callable[[dict[str, Any]], None] | None = None

    def _next(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    def _typed(
        self,
        name: str,
        fields: dict[str, Any],
        after: dict[str, Any] | None = None,
        tail: dict[str, Any] | None = None,
    ) -> bytes:
        """An event: `fields`, then sequence_number, `after`, type and `tail` (SDK field
        order)."""
        fields["sequence_number"] = self._next()
        if after:
            fields.update(after)
        fields["type"] = name
        if tail:
            fields.update(tail)
        return _event(name.encode(), orjson.dumps(fields))

    def usage(self, sent: int) -> dict[str, Any]:
        """vLLM's ResponseUsage (protocol.py), as responses_full_generator fills it for
        one turn: the per-turn lists stay empty (SimpleContext keeps no turn metrics)."""
        plan = self._plan
        cached = plan.cached_tokens or 0
        return {
            "input_tokens": plan.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": cached,
                "cache_write_tokens": wire.cache_writes(
                    plan.prompt_tokens, cached, plan.cache_block
                ),
                "input_tokens_per_turn": [],
                "cached_tokens_per_turn": [],
            },
            "output_tokens": sent,
            "output_tokens_details": {
                "reasoning_tokens": 0,
                "tool_output_tokens": 0,
                "output_tokens_per_turn": [],
                "tool_output_tokens_per_turn": [],
            },
            "total_tokens": plan.prompt_tokens + sent,
        }

    def response(
        self, status: str, output: list[Any], usage: Any, metrics: bytes | None = None
    ) -> dict[str, Any]:
        """vLLM's ResponsesResponse.from_request, in its field order."""
        body, plan = self._body, self._plan
        # vLLM reports the sampling limit: the request's, else what the context has left.
        max_output = plan.max_tokens if plan.max_tokens is not None else plan.token_limit
        incomplete = (
            {"reason": self._incomplete}
            if status == "incomplete" and self._incomplete is not None
            else None
        )
        out = {
            "id": self._id,
            "created_at": self._created,
            "incomplete_details": incomplete,
            "instructions": body.get("instructions"),
            "metadata": body.get("metadata"),
            "model": plan.model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": _number(body, "temperature", 1.0),
            "tool_choice": tool_choice(body),
            "tools": body.get("tools") or [],
            "top_p": _number(body, "top_p", 1.0),
            "background": bool(body.get("background", False)),
            "max_output_tokens": max_output,
            "max_tool_calls": body.get("max_tool_calls"),
            "previous_response_id": body.get("previous_response_id"),
            "prompt": None,
            "reasoning": body.get("reasoning"),
            "service_tier": body.get("service_tier", "auto"),
            "status": status,
            "text": body.get("text"),
            "top_logprobs": body.get("top_logprobs"),
            "truncation": body.get("truncation", "disabled"),
            "usage": usage,
            "user": body.get("user"),
        }
        if metrics is not None:  # after `user`, left out when None (exclude_if)
            out["metrics"] = orjson.Fragment(whole_metrics(metrics))
        # the sampling params' penalties, then what vLLM adds (protocol.py ResponsesResponse)
        out["presence_penalty"] = _number(body, "presence_penalty", 0.0)
        out["frequency_penalty"] = _number(body, "frequency_penalty", 0.0)
        out |= dict.fromkeys(_VLLM_NULLS)
        if self.on_final is not None and status not in _OPEN:
            self.on_final(out)
        return out

    def _message(self, text: str | None, status: str) -> dict[str, Any]:
        return message_item(self._item_id, text, status)

    def _final_status(self) -> str:
        return "completed" if self._incomplete is None else "incomplete"

    # -- streamed ------------------------------------------------------------

    def opening(self) -> list[bytes]:
        initial = self.response("in_progress", [], None)
        return [
            self._typed("response.created", {"response": initial}),
            self._typed("response.in_progress", {"response": initial}),
        ]

    def first_output(self) -> list[bytes]:
        return []  # vLLM's Responses stream opens before the engine's first output

    def block_start(self) -> list[bytes]:
        part = output_text("", [])
        return [
            self._typed(
                "response.output_item.added",
                {"item": self._message(None, "in_progress"), "output_index": 0},
            ),
            self._typed(
                "response.content_part.added",
                {"content_index": 0, "item_id": self._item_id, "output_index": 0, "part": part},
            ),
        ]

    def content(self, text: bytes) -> bytes:
        pre = self._pre
        if self._stamp == "text":
            text = stamp_text(text)
        elif self._stamp:
            pre = pre.replace(b"data: {", b'data: {"sent_ns":%d,' % time.time_ns(), 1)
        return (
            pre + text + self._post + b'%d,"type":"response.output_text.delta"}\n\n' % self._next()
        )

    def closing(self, sent: int, started: bool) -> list[bytes]:
        out = []
        output = []
        if started:
            text = completion_text(sent)
            part = output_text(text, None)
            message = self._message(text, "completed")
            output.append(message)
            out += [
                self._typed(
                    "response.output_text.done",
                    {
                        "content_index": 0,
                        "item_id": self._item_id,
                        "logprobs": [],
                        "output_index": 0,
                    },
                    {"text": text},
                ),
                self._typed(
                    "response.content_part.done",
                    {
                        "content_index": 0,
                        "item_id": self._item_id,
                        "output_index": 0,
                        "part": part,
                    },
                ),
                self._typed("response.output_item.done", {"item": message, "output_index": 0}),
            ]
        status = self._final_status()
        generated = sent + self._plan.eos  # the EOS has no text but is counted
        metrics = None if self.metrics is None else self.metrics(generated, True)
        final = self.response(status, output, self.usage(generated), metrics)
        name = (
            "response.incomplete"
            if status == "incomplete" and self._plan.incomplete_event
            else "response.completed"
        )
        out.append(self._typed(name, {"response": final}))
        return out

    def error(self, chat_error: bytes) -> bytes:
        message = wire.chat_error_message(chat_error)
        fields = {"code": "InternalServerError", "message": message, "param": None}
        return self._typed("error", fields)

    # -- not streamed --------------------------------------------------------

    def full(self, sent: int) -> bytes:
        output = [self._message(completion_text(sent), "completed")] if sent else []
        generated = sent + self._plan.eos  # the EOS has no text but is counted
        metrics = None if self.metrics is None else self.metrics(generated, False)
        usage = self.usage(generated)
        return orjson.dumps(self.response(self._final_status(), output, usage, metrics))
