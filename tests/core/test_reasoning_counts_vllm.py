"""Reasoning counts against what a real vLLM 0.32 generated (a read-only review, R7, ran
its tiny random reasoning model with `--reasoning-parser deepseek_r1` and read the true
token ids with `return_token_ids`): real captures (tests/fixtures/streams/
vllm-0.32-reasoning and vllm-0.32-held, whose READMEs give each request and its ids) and
streams and bodies in vLLM's bytes carrying the review's figures, fed one event a read.

- vLLM streams an empty `"reasoning": ""` delta for each reasoning token whose bytes its
  detokenizer holds back (broken UTF-8): a reasoning token, not only an output.
- A tokenizer re-counting the reasoning text can say more than the output holds (the
  random model's broken UTF-8 arrives as U+FFFD, three bytes, and re-tokenizes long).
- A body of reasoning alone whose `<think>` came late: usage counts only after it.
- A body of one token (the EOS), no text, no call: its client got no answer.

Times are multiples of 1/8 s, exact in binary.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson

from proxy.core.apis.messages import Messages
from proxy.core.measurement import Measurement
from proxy.core.observe import Counter, StreamObserver
from proxy.core.request import CHAT, RequestInfo
from tests.paths import FIXTURES
from tests.tokenizers_local import loaded_counter

STREAMS = FIXTURES / "streams"
MESSAGES = Messages.endpoint
SSE, JSON = "text/event-stream", "application/json"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
#: The random model's text: broken UTF-8 arrives as U+FFFD (3 bytes, 3 tokens of a
#: byte-level BPE that never saw it: the tiny tokenizer of tests/tokenizers_local.py).
BROKEN = "\ufffd\ufffd"


def request(stream: bool, endpoint: str = CHAT, tools: bool = False) -> RequestInfo:
    template = {"tools": TOOLS} if tools else None
    return RequestInfo(endpoint, "tiny", stream, True, 40, 1.0, template=template)


def observe(
    info: RequestInfo, reads: list[bytes], content_type: str, counter: Counter | None = None
) -> Measurement:
    """Each read fed 1/8 s after the last; `counter` as with --tokenizer."""
    observer = StreamObserver(info, start=0.0, collect_text=counter is not None)
    observer.open(200, content_type, 0.125)
    now = 0.125
    for read in reads:
        now += 0.125
        observer.feed(read, now)
    observer.end_of_stream(now + 0.125)
    finished = observer.finish(
        end=now + 0.125, started_at=1_796_690_000.0, status_code=200, error_type=None,
        error_message=None, counter=counter,
    )  # fmt: skip
    return asyncio.run(finished)


def captured(name: str) -> list[bytes]:
    raw = (STREAMS / name).read_bytes()
    return [part + b"\n\n" for part in raw.split(b"\n\n") if part]


# -- vLLM's bytes ---------------------------------------------------------------------------


def chunk(delta: dict[str, Any], finish: str | None = None, index: int = 0) -> bytes:
    """A chat chunk as vLLM 0.32 writes it (tests/fixtures/streams/vllm-0.32-reasoning): a
    finish carries `stop_reason`, passed explicitly (chat_completion/serving.py)."""
    choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None,
                              "finish_reason": finish}  # fmt: skip
    if finish is not None:
        choice["stop_reason"] = None
    choice["token_ids"] = None
    obj = {"id": "chatcmpl-r7", "object": "chat.completion.chunk", "created": 1796690969,
           "model": "tiny", "choices": [choice]}  # fmt: skip
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def usage_chunk(output: int, reasoning: int) -> bytes:
    usage = {"prompt_tokens": 180, "total_tokens": 180 + output, "completion_tokens": output,
             "completion_tokens_details": {"reasoning_tokens": reasoning}}  # fmt: skip
    obj = {"id": "chatcmpl-r7", "object": "chat.completion.chunk", "created": 1796690969,
           "model": "tiny", "choices": [], "usage": usage}  # fmt: skip
    return b"data: " + orjson.dumps(obj) + b"\n\n"


ROLE = chunk({"role": "assistant", "content": ""})
DONE = b"data: [DONE]\n\n"


def r7_stream(reasoned: str = "r", usage: int = 0) -> list[bytes]:
    """The review's s4t4 generation (seed 144, max_tokens 40, a bias on `</think>`): 27
    reasoning tokens, 15 streamed with text and 12 as `"reasoning": ""`, then `</think>`
    (no chunk: the parser gives none for the marker alone), 12 answer tokens, the last
    with `length`; usage 40 output tokens and `reasoning` (0: no `<think>` generated)."""
    reads = [ROLE]
    for i in range(27):
        reads.append(chunk({"reasoning": "" if i % 9 in (1, 3, 5, 7) else reasoned}))
    reads += [chunk({"content": f" a{i}"}) for i in range(11)]
    reads += [chunk({"content": " a11"}, "length"), usage_chunk(40, usage), DONE]
    return reads


# -- E: vLLM's empty reasoning deltas are reasoning tokens ----------------------------------


def test_the_r7_stream_counts_its_empty_reasoning_deltas() -> None:
    reads = r7_stream()
    assert sum(b'"reasoning":""' in r for r in reads) == 12
    m = observe(request(stream=True), reads, SSE)
    assert (m.output_tokens, m.reasoning_events) == (40, 15)
    assert (m.reasoning_tokens, m.reasoning_token_source) == (27, "events")  # was 15
    assert m.without_answer is None


def test_a_real_held_reasoning_token_is_counted() -> None:
    """The capture's first generated token was reasoning, its text held (`""`), then 5
    reasoning deltas; `</think>` is the 7th token (its README): 6 reasoning tokens, where
    the reasoning deltas with text said 5."""
    m = observe(request(stream=True, tools=True),
                captured("vllm-0.32-reasoning/tools_seed2_chat_stream.sse"), SSE)  # fmt: skip
    assert (m.reasoning_tokens, m.reasoning_token_source) == (6, "events")


def test_two_choices_that_reasoned_to_their_limit_count_every_token() -> None:
    """The capture: n=2, max_tokens 12, no usage; each choice reasoned until `length`, 24
    tokens, 14 reasoning deltas with text. The last token of choice 0 was held too: its
    `length` rides on `"reasoning": ""`, a token cut by the limit, which was reasoning."""
    reads = captured("vllm-0.32-held/chat_n2_no_usage.sse")
    m = observe(request(stream=True), reads, SSE)
    assert (m.output_tokens, m.reasoning_events) == (24, 14)
    assert (m.reasoning_tokens, m.reasoning_token_source) == (24, "events")  # was 14


def test_the_eos_s_empty_reasoning_delta_is_no_reasoning() -> None:
    """A stream that ends by its EOS while still in the reasoning (no `</think>`): the EOS
    comes as `"reasoning": ""` with the finish `stop`; it is output, not reasoning. (Tools
    offered, so the stream's tokens are not all taken for reasoning: the events count.)"""
    reads = [ROLE, chunk({"reasoning": "r"}), chunk({"reasoning": ""}), chunk({"reasoning": "r"}),
             chunk({"reasoning": ""}, "stop"), usage_chunk(4, 0), DONE]  # fmt: skip
    m = observe(request(stream=True, tools=True), reads, SSE)
    assert (m.output_tokens, m.reasoning_tokens, m.reasoning_token_source) == (4, 3, "events")


def test_usage_below_the_reasoning_tokens_the_stream_carried_is_refused() -> None:
    """Each reasoning delta, empty or not, is a token: usage's 20 is below the stream's 27."""
    m = observe(request(stream=True), r7_stream(usage=20), SSE)
    assert (m.reasoning_tokens, m.reasoning_token_source) == (27, "events")  # was 20, usage


# -- G: a tokenizer's count is no more than the output can hold -----------------------------


def test_a_tokenizer_s_reasoning_count_is_capped_by_the_exact_output(tmp_path: Path) -> None:
    """The same stream, counted by a tokenizer: the broken text re-tokenizes long. With
    usage's 40 output tokens and 12 answer events, at most 28 were reasoning (the review:
    46 logged for 40 output). Where the output is large enough the count stands."""
    counter = loaded_counter(tmp_path)
    try:
        roomy = r7_stream(BROKEN)
        roomy[-2] = usage_chunk(1000, 0)
        raw = observe(request(stream=True), roomy, SSE, counter)
        capped = observe(request(stream=True), r7_stream(BROKEN), SSE, counter)
    finally:
        counter.close()
    assert raw.reasoning_token_source == "tokenizer" and raw.reasoning_tokens is not None
    assert raw.reasoning_tokens > 40  # what the text re-tokenizes to
    assert (capped.output_tokens, capped.reasoning_tokens) == (40, 28)  # was raw's
    assert capped.reasoning_token_source == "tokenizer"


def messages_event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: %s\ndata: %s\n\n" % (kind.encode(), orjson.dumps({"type": kind, **data}))


def test_a_tokenizer_s_messages_thinking_count_is_capped_too(tmp_path: Path) -> None:
    """Messages usage has no reasoning count: the thinking is counted from the stream, by a
    tokenizer with --tokenizer; at most the output less the text events (the review: 859
    for 498 output over its Messages requests)."""
    start = {"message": {"id": "chatcmpl-m", "type": "message", "role": "assistant",
                         "content": [], "model": "tiny", "stop_reason": None,
                         "usage": {"input_tokens": 93, "output_tokens": 0}}}  # fmt: skip
    reads = [messages_event("message_start", start),
             messages_event("content_block_start", {"index": 0, "content_block": {
                 "type": "thinking", "thinking": ""}})]  # fmt: skip
    thinking = {"type": "thinking_delta", "thinking": BROKEN}
    reads += [messages_event("content_block_delta", {"index": 0, "delta": thinking})] * 10
    reads += [messages_event("content_block_stop", {"index": 0}),
              messages_event("content_block_start", {"index": 1, "content_block": {
                  "type": "text", "text": ""}})]  # fmt: skip
    text = {"type": "text_delta", "text": " a"}
    reads += [messages_event("content_block_delta", {"index": 1, "delta": text})] * 4
    reads += [messages_event("content_block_stop", {"index": 1}),
              messages_event("message_delta", {"delta": {"stop_reason": "max_tokens"},
                                               "usage": {"output_tokens": 20}}),
              messages_event("message_stop", {})]  # fmt: skip
    counter = loaded_counter(tmp_path)
    try:
        m = observe(request(stream=True, endpoint=MESSAGES), reads, SSE, counter)
    finally:
        counter.close()
    assert (m.output_tokens, m.reasoning_events) == (20, 10)
    assert (m.reasoning_tokens, m.reasoning_token_source) == (16, "tokenizer")  # 20 - 4


# -- B: a body of reasoning alone whose usage counts only after a late <think> --------------


def body(message: dict[str, Any], finish: str, output: int, reasoning: int) -> bytes:
    """A chat body as vLLM 0.32 writes it (chat_completion/serving.py, non-streaming)."""
    return orjson.dumps({
        "id": "chatcmpl-b", "object": "chat.completion", "created": 1796690969, "model": "tiny",
        "choices": [{"index": 0, "message": {"role": "assistant", **message}, "logprobs": None,
                     "finish_reason": finish, "stop_reason": None, "token_ids": None}],
        "usage": {"prompt_tokens": 180, "total_tokens": 180 + output, "completion_tokens": output,
                  "completion_tokens_details": {"reasoning_tokens": reasoning}},
    })  # fmt: skip


#: The review's p-none2 generation, not streamed (its message as vLLM wrote it): no
#: `</think>`, a `<think>` generated late; vLLM's extract_reasoning drops the text before it
#: and count_reasoning_tokens counts only after it (vllm/reasoning/basic_parsers.py): usage 4
#: of 40 (truth 39 before `</think>`; the same generation streamed: 24 reasoning events).
LATE_THINK = {"content": "", "reasoning": "\x08\x1f\ufffd ju", "tool_calls": []}


def test_a_body_of_reasoning_alone_with_usage_far_below_its_output_is_all_reasoning() -> None:
    """The review's request offered a tool (`tool_choice: "none"`); where tools are offered
    the rest may be a call's tokens that left no call (tests/core/test_reasoning_bounds.py,
    the harmony body), so usage stands there: the same body for a request without tools."""
    m = observe(request(stream=False), [body(LATE_THINK, "length", 40, 4)], JSON)
    assert (m.output_tokens, m.reasoning_tokens, m.reasoning_token_source) == (40, 40, "output")
    assert m.without_answer == "length"


def test_a_body_of_reasoning_alone_keeps_usage_that_leaves_room_for_markers_and_eos() -> None:
    """`<think>`, 37 reasoning tokens, `</think>` and the EOS: usage 37 of 40 is right (the
    content after `</think>` is null: vLLM's extract_reasoning)."""
    message = {**LATE_THINK, "reasoning": "r" * 37}
    m = observe(request(stream=False), [body(message, "stop", 40, 37)], JSON)
    assert (m.reasoning_tokens, m.reasoning_token_source) == (37, "usage")


# -- a body without an answer, a call or reasoning -----------------------------------------


def test_a_body_of_one_eos_token_and_no_answer_is_without_answer() -> None:
    """The review's repro_empty: tool_choice "required", one token (the EOS), finish
    `tool_calls`, no call and no content; the same generation streamed was `stop`."""
    empty = {"content": None, "tool_calls": []}
    m = observe(request(stream=False, tools=True), [body(empty, "tool_calls", 1, 0)], JSON)
    assert (m.output_tokens, m.finish_reason) == (1, "tool_calls")
    assert m.without_answer == "stop"  # was None
    streamed = [ROLE, chunk({"content": ""}, "tool_calls"), usage_chunk(1, 0), DONE]
    assert observe(request(stream=True, tools=True), streamed, SSE).without_answer == "stop"


def test_a_body_with_an_answer_or_no_output_is_not_without_answer() -> None:
    answered = observe(request(stream=False), [body({"content": "Sunny."}, "stop", 3, 0)], JSON)
    assert answered.without_answer is None
    nothing = observe(request(stream=False), [body({"content": ""}, "stop", 0, 0)], JSON)
    assert nothing.without_answer is None
