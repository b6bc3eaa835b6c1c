"""Reasoning counts and phase timings the bytes cannot vouch for: real vLLM 0.32 answers
(tests/fixtures/streams/vllm-0.32-reasoning/README.md gives each request and its token
ids), fed one event a read at synthetic times, and streams of one read.

Times are multiples of 1/8 s, exact in binary, so durations compare with `==`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from proxy.core.measurement import Measurement
from proxy.core.observe import StreamObserver
from proxy.core.request import CHAT, RequestInfo
from tests.paths import FIXTURES

REASONING = FIXTURES / "streams" / "vllm-0.32-reasoning"
START = 100.0
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


def request(stream: bool, tools: list[Any] | None = None) -> RequestInfo:
    template = {"tools": tools} if tools else None
    return RequestInfo(CHAT, "tiny", stream, True, 60, 1.0, template=template)


def observe(info: RequestInfo, reads: list[bytes], content_type: str) -> Measurement:
    """Each read fed 1/8 s after the last, the body ending cleanly 1/8 s after them."""
    observer = StreamObserver(info, start=START)
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
    from usage, and without a tokenizer none is claimed. The same generation streamed was
    logged 1 (events); the body was logged 21 (usage)."""
    body = (REASONING / "bias_think_seed5_chat_nonstream.json").read_bytes()
    said = orjson.loads(body)["usage"]["completion_tokens_details"]["reasoning_tokens"]
    m = observe(request(stream=False), [body], "application/json")
    assert said == 21
    assert (m.output_tokens, m.reasoning_tokens, m.reasoning_token_source) == (40, None, None)
    streamed = observe(request(stream=True), events("bias_think_seed5_chat_stream.sse"),
                       "text/event-stream")  # fmt: skip
    assert (streamed.reasoning_tokens, streamed.reasoning_token_source) == (1, "events")


def test_a_whole_answer_s_usage_within_its_reasoning_text_is_taken() -> None:
    """21 reasoning tokens fit a reasoning text of 21 bytes: usage's count stands."""
    body = orjson.loads((REASONING / "bias_think_seed5_chat_nonstream.json").read_bytes())
    body["choices"][0]["message"]["reasoning"] = "r" * 21
    m = observe(request(stream=False), [orjson.dumps(body)], "application/json")
    assert (m.reasoning_tokens, m.reasoning_token_source) == (21, "usage")


def test_reasoning_then_nothing_is_not_all_output_where_tools_were_offered() -> None:
    """The real stream: 5 reasoning deltas, a bare `length` finish, usage 60 output tokens.
    With tools offered, the 53 tokens after `</think>` went into a <tool_call> the hermes
    parser never sent: the record counts the reasoning events (a lower bound), not all 60.
    The same bytes for a request without tools (no parser could hold text) still mean a
    stream cut off while it reasoned."""
    reads = events("tools_seed2_chat_stream.sse")
    m = observe(request(stream=True, tools=TOOLS), reads, "text/event-stream")
    assert (m.output_tokens, m.reasoning_tokens, m.reasoning_token_source) == (60, 5, "events")
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
