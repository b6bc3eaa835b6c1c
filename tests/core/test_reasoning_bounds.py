"""Reasoning counts and phase timings the bytes cannot vouch for: real vLLM 0.32 answers
(tests/fixtures/streams/vllm-0.32-reasoning/README.md gives each request and its token
ids), fed one event a read at synthetic times, and streams of one read.

Times are multiples of 1/8 s, exact in binary, so durations compare with `==`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from proxy.core.apis.responses import Responses
from proxy.core.measurement import Measurement
from proxy.core.observe import StreamObserver
from proxy.core.request import CHAT, RequestInfo
from tests.paths import FIXTURES

REASONING = FIXTURES / "streams" / "vllm-0.32-reasoning"
RESPONSES = Responses.endpoint
START = 100.0
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


def request(stream: bool, tools: list[Any] | None = None, endpoint: str = CHAT) -> RequestInfo:
    template = {"tools": tools} if tools else None
    return RequestInfo(endpoint, "tiny", stream, True, 60, 1.0, template=template)


def observe(
    info: RequestInfo, reads: list[bytes], content_type: str, collect: bool = False
) -> Measurement:
    """Each read fed 1/8 s after the last, the body ending cleanly 1/8 s after them;
    `collect` as with --tokenizer (the texts kept, none counted: no counter here)."""
    observer = StreamObserver(info, start=START, collect_text=collect)
    observer.open(200, content_type, START + 0.125)
    now = START + 0.125
    for chunk in reads:
        now += 0.125
        observer.feed(chunk, now)
    observer.end_of_stream(now + 0.125)
    return asyncio.run(
        observer.finish(
            end=now + 0.125,
            started_at=1_718_000_000.0,
            status_code=200,
            error_type=None,
            error_message=None,
        )
    )


def events(name: str) -> list[bytes]:
    raw = (REASONING / name).read_bytes()
    return [part + b"\n\n" for part in raw.split(b"\n\n") if part]


def test_a_whole_answer_s_usage_above_what_its_reasoning_text_can_hold_is_not_taken() -> None:
    """vLLM says 21 reasoning tokens for a body whose reasoning is "+" (one byte: one token
    of the parser's, the first `</think>` is the 4th generated token): no count is taken
    from usage, and without a tokenizer none is claimed. The same generation streamed 2
    reasoning tokens: the first generated held back (`"reasoning": ""`), then "+" (the
    `<think>` between them streams nothing); the body was logged 21 (usage)."""
    body = (REASONING / "bias_think_seed5_chat_nonstream.json").read_bytes()
    said = orjson.loads(body)["usage"]["completion_tokens_details"]["reasoning_tokens"]
    m = observe(request(stream=False), [body], "application/json")
    assert said == 21
    assert (m.output_tokens, m.reasoning_tokens, m.reasoning_token_source) == (40, None, None)
    streamed = observe(request(stream=True), events("bias_think_seed5_chat_stream.sse"),
                       "text/event-stream")  # fmt: skip
    assert (streamed.reasoning_tokens, streamed.reasoning_token_source) == (2, "events")


def test_a_whole_answer_s_usage_within_its_reasoning_text_is_taken() -> None:
    """21 reasoning tokens fit a reasoning text of 21 bytes: usage's count stands."""
    body = orjson.loads((REASONING / "bias_think_seed5_chat_nonstream.json").read_bytes())
    body["choices"][0]["message"]["reasoning"] = "r" * 21
    m = observe(request(stream=False), [orjson.dumps(body)], "application/json")
    assert (m.reasoning_tokens, m.reasoning_token_source) == (21, "usage")


def test_reasoning_then_nothing_is_not_all_output_where_tools_were_offered() -> None:
    """The real stream: 6 reasoning deltas (the first empty: its text held back), a bare
    `length` finish, usage 60 output tokens.
    With tools offered, the 53 tokens after `</think>` went into a <tool_call> the hermes
    parser never sent: the record counts the reasoning events (a lower bound), not all 60.
    The same bytes for a request without tools (no parser could hold text) still mean a
    stream cut off while it reasoned."""
    reads = events("tools_seed2_chat_stream.sse")
    m = observe(request(stream=True, tools=TOOLS), reads, "text/event-stream")
    assert (m.output_tokens, m.reasoning_tokens, m.reasoning_token_source) == (60, 6, "events")
    assert m.without_answer == "length"
    alone = observe(request(stream=True), reads, "text/event-stream")
    assert (alone.reasoning_tokens, alone.reasoning_token_source) == (60, "output")


def chat_stream(deltas: list[dict[str, str]], output: int, finish_reason: str) -> list[bytes]:
    """A chat stream of `deltas`, its finish and a usage of `output` tokens, one read each."""
    chunks: list[dict[str, Any]] = [{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}]
    chunks += [{"choices": [{"index": 0, "delta": delta}]} for delta in deltas]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish_reason}]})
    usage = {"prompt_tokens": 5, "completion_tokens": output, "total_tokens": 5 + output,
             "completion_tokens_details": {"reasoning_tokens": 0}}  # fmt: skip
    chunks.append({"choices": [], "usage": usage})
    return [b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]


def test_an_answer_phase_is_not_timed_where_a_tool_parser_could_have_held_its_tokens() -> None:
    """As on the real vLLM (auto_calls seed 1: 5 reasoning, 3 answer deltas, `length` at
    60 tokens): the answer's count (output less reasoning) may hold a call's tokens that
    never streamed; dividing the answer's time by them gave a TPOT of microseconds."""
    deltas = [{"reasoning": f"r{i}"} for i in range(5)] + [{"content": f"a{i}"} for i in range(3)]
    reads = chat_stream(deltas, 60, "length")
    offered = observe(request(stream=True, tools=TOOLS), reads, "text/event-stream")
    assert (offered.reasoning_tokens, offered.answer_tpot) == (5, None)
    alone = observe(request(stream=True), reads, "text/event-stream")
    assert alone.answer_tpot == 0.25 / 54  # (last answer - first) / (60 - 5 - 1)


def test_tokens_that_all_arrive_in_one_read_give_no_time_per_token() -> None:
    """A short stream whose 3 tokens, finish and usage came in one read measured no time:
    no TPOT (not 0), as decode speed has none; nor a phase's."""
    deltas = [{"reasoning": "r0"}, {"reasoning": "r1"}, {"content": "a0"}, {"content": "a1"}]
    whole = b"".join(chat_stream(deltas, 4, "length"))
    m = observe(request(stream=True), [whole], "text/event-stream")
    assert (m.output_tokens, m.content_events) == (4, 4)
    assert (m.tpot, m.decode_tokens_per_second) == (None, None)
    assert (m.reasoning_tpot, m.answer_tpot) == (None, None)


#: A Responses body in OpenAI's shape: the reasoning item carries a summary of the reasoning
#: and no text of its own (openai-python src/openai/types/responses/
#: response_reasoning_item.py: `summary` a list of summary_text, `content` the reasoning
#: text only where given), usage 480 reasoning tokens. (The rev5 review's body.)
SUMMARISED = {"id": "resp_1", "object": "response", "model": "m", "status": "completed",
  "output": [
    {"id": "rs_1", "type": "reasoning", "summary": [
        {"type": "summary_text", "text": "**Adding numbers**\n\nThe user asks 2+2; answer 4."}]},
    {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
     "content": [{"type": "output_text", "text": "4", "annotations": []}]}],
  "usage": {"input_tokens": 12, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 490, "output_tokens_details": {"reasoning_tokens": 480},
            "total_tokens": 502}}  # fmt: skip


def test_a_summary_of_the_reasoning_bounds_no_count() -> None:
    """A summary is not the reasoning usage counts: its 48 bytes bound nothing, and usage's
    480 stands (d22735d took the summary for the reasoning text: no count at all)."""
    m = observe(request(False, endpoint=RESPONSES), [orjson.dumps(SUMMARISED)], "application/json")
    assert (m.reasoning_tokens, m.reasoning_token_source) == (480, "usage")


def test_a_summary_beside_the_reasoning_s_own_text_leaves_that_text_no_bound() -> None:
    """One reasoning item gives its text, another only a summary: the text kept is not all
    the reasoning, so it bounds nothing either."""
    body: dict[str, Any] = orjson.loads(orjson.dumps(SUMMARISED))
    told = {"id": "rs_0", "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": "2+2"}]}  # fmt: skip
    body["output"].insert(0, told)
    m = observe(request(False, endpoint=RESPONSES), [orjson.dumps(body)], "application/json")
    assert (m.reasoning_tokens, m.reasoning_token_source) == (480, "usage")


def test_the_reasoning_s_own_text_in_a_responses_body_still_bounds_usage() -> None:
    """vLLM's shape, the reasoning as `reasoning_text` content: 480 cannot come of 3 bytes."""
    body: dict[str, Any] = orjson.loads(orjson.dumps(SUMMARISED))
    body["output"][0] = {"id": "rs_0", "type": "reasoning", "summary": [],
                         "content": [{"type": "reasoning_text", "text": "2+2"}]}  # fmt: skip
    m = observe(request(False, endpoint=RESPONSES), [orjson.dumps(body)], "application/json")
    assert (m.reasoning_tokens, m.reasoning_token_source) == (None, None)


def responses_stream(kind: str, deltas: list[str]) -> list[bytes]:
    """A Responses stream whose reasoning came as `kind` deltas, then the answer "4", ending
    with the usage of SUMMARISED, one event a read."""
    created = {"type": "response.created", "response": {"id": "resp_1", "model": "m"}}
    done = {"type": "response.completed", "response": {**SUMMARISED, "output": []}}
    events: list[dict[str, Any]] = [created]
    events += [{"type": kind, "output_index": 0, "delta": delta} for delta in deltas]
    events.append({"type": "response.output_text.delta", "output_index": 1, "delta": "4"})
    events.append(done)
    return [b"event: %s\ndata: %s\n\n" % (e["type"].encode(), orjson.dumps(e)) for e in events]


def test_a_streamed_summary_collected_bounds_no_count() -> None:
    """With --tokenizer the texts are kept: a `reasoning_summary_text` delta's bounded usage
    by its 20 bytes (d22735d: the 2 events counted instead of usage's 480)."""
    reads = responses_stream("response.reasoning_summary_text.delta", ["**Adding**", " 2+2 is 4."])
    m = observe(request(True, endpoint=RESPONSES), reads, "text/event-stream", collect=True)
    assert (m.reasoning_tokens, m.reasoning_token_source) == (480, "usage")
    told = responses_stream("response.reasoning_text.delta", ["2+2", " is 4"])
    m = observe(request(True, endpoint=RESPONSES), told, "text/event-stream", collect=True)
    assert (m.reasoning_tokens, m.reasoning_token_source) == (2, "events")


#: gpt-oss through vLLM 0.32's harmony path, a whole chat answer that calls a tool: a short
#: analysis ("Call it.", 8 bytes), then a commentary message to=functions.get_weather with
#: long arguments. vllm/parser/harmony.py, `_is_reasoning_token`, counts as reasoning the
#: analysis channel and commentary with a recipient, so usage's 40 holds the call's tokens,
#: whose text is in `tool_calls`, not in `reasoning`. (Built from vLLM's source: no gpt-oss
#: capture here.)
ARGUMENTS = orjson.dumps({"city": "Paris", "units": "metric", "days": 7, "fields": [
    "temperature", "humidity", "wind", "pressure", "uv_index"]}).decode()  # fmt: skip
CALLED = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
  "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
      "role": "assistant", "content": None, "reasoning": "Call it.",
      "tool_calls": [{"id": "call_1", "type": "function",
                      "function": {"name": "get_weather", "arguments": ARGUMENTS}}]}}],
  "usage": {"prompt_tokens": 80, "completion_tokens": 45, "total_tokens": 125,
            "completion_tokens_details": {"reasoning_tokens": 40}}}  # fmt: skip


def test_a_harmony_call_s_tokens_counted_as_reasoning_are_not_refused() -> None:
    """The answer called a tool: its reasoning text bounds nothing, usage's 40 stands."""
    m = observe(request(False, tools=TOOLS), [orjson.dumps(CALLED)], "application/json")
    assert (m.reasoning_tokens, m.reasoning_token_source) == (40, "usage")


def test_a_request_that_offered_tools_leaves_its_reasoning_text_no_bound() -> None:
    """No call came back (a call cut by `length`, or to a name no tool has, leaves none),
    yet the tokens written to a recipient were counted as reasoning: where tools were
    offered the text bounds nothing. Without tools the same body's 40 is refused by it."""
    body: dict[str, Any] = orjson.loads(orjson.dumps(CALLED))
    choice = body["choices"][0]
    choice["finish_reason"], choice["message"]["tool_calls"] = "length", None
    offered = observe(request(False, tools=TOOLS), [orjson.dumps(body)], "application/json")
    assert (offered.reasoning_tokens, offered.reasoning_token_source) == (40, "usage")
    alone = observe(request(False), [orjson.dumps(body)], "application/json")
    assert alone.reasoning_token_source != "usage"


def test_a_built_in_tool_s_item_leaves_the_reasoning_text_no_bound() -> None:
    """Responses with a built-in tool (no function offered): the text a harmony model wrote
    to `python` is in a code_interpreter_call item (responses/harmony.py,
    harmony_to_response_output), counted as reasoning (analysis channel)."""
    body: dict[str, Any] = orjson.loads(orjson.dumps(SUMMARISED))
    body["output"][0] = {"id": "rs_0", "type": "reasoning", "summary": [],
                         "content": [{"type": "reasoning_text", "text": "2+2"}]}  # fmt: skip
    body["output"].insert(1, {"id": "ci_1", "type": "code_interpreter_call",
                              "code": "print(2+2)", "status": "completed"})  # fmt: skip
    m = observe(request(False, endpoint=RESPONSES), [orjson.dumps(body)], "application/json")
    assert (m.reasoning_tokens, m.reasoning_token_source) == (480, "usage")
