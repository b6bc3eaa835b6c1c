"""TPOT and decode speed where vLLM held a stream's last tokens back: a real vLLM 0.32
stream (tests/fixtures/streams/vllm-0.32-reasoning/README.md) and streams written as vLLM
0.32 writes them, fed one event a read at synthetic times.

vLLM skips a step whose parser gives no delta unless it finishes; the finish then comes
with an empty delta (chat_completion/serving.py, `if delta_message is None`; completions
send an empty `text`), `stop_reason` beside it. So a `length` finish on such a chunk is
the read of the last token's own step, however many held tokens came between it and the
last content; and a count of what streamed (the chunks, a tokenizer's count of the texts)
leaves every held token out while the span holds their steps.

Times are multiples of 1/8 s, exact in binary, so durations compare with `==`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson

from proxy.core.apis import api_for
from proxy.core.measurement import Measurement, TokenSource
from proxy.core.observe import Counter, StreamObserver
from tests.paths import FIXTURES
from tests.tokenizers_local import loaded_counter

REASONING = FIXTURES / "streams" / "vllm-0.32-reasoning"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
STEP = 1 / 8
QUESTION = {"role": "user", "content": "what is the weather?"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
DONE = b"data: [DONE]\n\n"


def replay(
    endpoint: str,
    body: dict[str, Any],
    timed: list[tuple[float, bytes]],
    counter: Counter | None = None,
) -> Measurement:
    """The record of `timed` (read instant, event), the request read from `body`."""
    api = api_for(endpoint)
    assert api is not None
    observer = StreamObserver(api.read_request(body), 0.0, collect_text=counter is not None)
    observer.open(200, "text/event-stream; charset=utf-8", 0.0)
    for now, event in timed:
        observer.feed(event, now)
    end = timed[-1][0]
    observer.end_of_stream(end)
    finished = observer.finish(
        end=end, started_at=0.0, status_code=200, error_type=None, error_message=None,
        counter=counter,
    )  # fmt: skip
    return asyncio.run(finished)


def chunk(choice: dict[str, Any], obj: str = "chat.completion.chunk") -> bytes:
    return b"data: " + orjson.dumps({"id": "x", "object": obj, "model": "tiny",
                                     "choices": [choice]}) + b"\n\n"  # fmt: skip


def delta(index: int, **fields: object) -> bytes:
    """A chat chunk as vLLM writes one mid-stream."""
    return chunk({"index": index, "delta": fields, "logprobs": None, "finish_reason": None,
                  "token_ids": None})  # fmt: skip


def held_finish(index: int, why: str, fields: dict[str, str] | None = None) -> bytes:
    """vLLM's finish chunk for a step whose parser gave no delta (`{}`), or whose text the
    detokenizer holds back (`{"content": ""}`): `stop_reason` always written."""
    return chunk({"index": index, "delta": fields or {}, "logprobs": None,
                  "finish_reason": why, "stop_reason": None, "token_ids": None})  # fmt: skip


def usage(output: int) -> bytes:
    obj = {"id": "x", "object": "chat.completion.chunk", "model": "tiny", "choices": [],
           "usage": {"prompt_tokens": 22, "total_tokens": 22 + output,
                     "completion_tokens": output}}  # fmt: skip
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def body(n: int = 1, tools: bool = False, usage: bool = True) -> dict[str, Any]:
    found: dict[str, Any] = {"model": "tiny", "messages": [QUESTION], "stream": True, "n": n}
    if usage:
        found["stream_options"] = {"include_usage": True}
    if tools:
        found["tools"] = TOOLS
    return found


# -- a `length` finish on an empty chunk is the last token's read ---------------------------


def test_a_real_length_finish_after_a_held_call_ends_the_span_at_its_read() -> None:
    """The real stream: token 0's reasoning held (`""`), 5 reasoning deltas, `</think>`
    and 53 tokens of a `<tool_call>` the hermes parser kept, then `length` on `{}` at the
    60th token's step; usage 60. Token k is read at step k + 1: the span is the 60th
    token's read less the first content's, over 59. Ended at the last content read, it
    was 4 steps over 59 (against the real vLLM, 0.16 ms where 1.6 ms was true)."""
    events = [e + b"\n\n" for e in (REASONING / "tools_seed2_chat_stream.sse").read_bytes()
              .split(b"\n\n") if e]  # fmt: skip
    role, *tokens, finish, counted, done = events
    assert b'"finish_reason":"length"' in finish and b'"delta":{}' in finish
    assert len(tokens) == 6  # `""`, then 5 reasoning deltas
    timed = [(STEP, role), *((STEP * (k + 1), e) for k, e in enumerate(tokens))]
    timed += [(STEP * 60, finish), (STEP * 60, counted), (STEP * 60, done)]
    for offered in (True, False):
        m = replay(CHAT, body(tools=offered), timed)
        assert (m.output_tokens, m.token_source) == (60, TokenSource.USAGE)
        assert m.ttft == STEP * 2  # token 1, the first reasoning text
        assert m.tpot == (STEP * 60 - STEP * 2) / 59, offered
        assert m.decode_tokens_per_second == 59 / (STEP * 60 - STEP * 2), offered


def test_a_held_back_last_token_s_length_finish_ends_its_choice_s_span() -> None:
    """4 tokens, the last one's text held back (a possible stop string's start), so
    `length` comes on `{"content": ""}` at its step: 3 gaps of a step. n=2 with usage: each
    choice's own finish read ends its span (each counts 4 of the 8 by its events)."""
    for n in (1, 2):
        timed = [(STEP, delta(i, role="assistant", content="")) for i in range(n)]
        for step in (1, 2, 3):
            timed += [(STEP * step, delta(i, content=f" w{step}")) for i in range(n)]
        timed += [(STEP * 4, held_finish(i, "length", {"content": ""})) for i in range(n)]
        timed += [(STEP * 4, usage(4 * n)), (STEP * 4, DONE)]
        m = replay(CHAT, body(n), timed)
        assert (m.output_tokens, m.content_events) == (4 * n, 3 * n)
        assert m.tpot == STEP, n  # not 2/3 of a step
        assert m.finish_reasons == (("length",) * n if n > 1 else ())


def test_a_completions_length_finish_with_an_empty_text_ends_the_span() -> None:
    """Completions' held step: `"text": ""` with the finish and `stop_reason`."""

    def text(value: str, why: str | None = None) -> bytes:
        return chunk({"index": 0, "text": value, "logprobs": None, "finish_reason": why,
                      "stop_reason": None, "token_ids": None}, "text_completion")  # fmt: skip

    timed = [(STEP * step, text(f" w{step}")) for step in (1, 2, 3)]
    timed += [(STEP * 4, text("", "length")), (STEP * 4, usage(4)), (STEP * 4, DONE)]
    request = {"model": "tiny", "prompt": "hi", "stream": True,
               "stream_options": {"include_usage": True}}  # fmt: skip
    m = replay(COMPLETIONS, request, timed)
    assert (m.output_tokens, m.token_source, m.tpot) == (4, TokenSource.USAGE, STEP)


def test_a_length_finish_in_a_chunk_of_its_own_without_stop_reason_ends_no_span() -> None:
    """OpenAI and llama-server end a choice with `delta: {}` and no `stop_reason`, on the
    last content's step: a later read of it (here a step later) is no token's."""
    timed = [(STEP, delta(0, role="assistant", content=""))]
    timed += [(STEP * step, delta(0, content=f" w{step}")) for step in (1, 2, 3, 4)]
    bare = chunk({"index": 0, "delta": {}, "finish_reason": "length"})
    timed += [(STEP * 5, bare), (STEP * 5, usage(4)), (STEP * 5, DONE)]
    m = replay(CHAT, body(), timed)
    assert (m.output_tokens, m.tpot) == (4, STEP)


# -- counts of what streamed, where a tool parser may have held tokens ---------------------


def required_calls(choices: int) -> list[tuple[float, bytes]]:
    """n choices forced to call, as vLLM streams `tool_choice: "required"`: each choice's
    call name and two argument pieces, the JSON around them held (no chunk), cut by
    `length` on `{}` at its 40th token's step (the review's request: max_tokens 40)."""
    timed = [(STEP, delta(i, role="assistant", content="")) for i in range(choices)]
    for i in range(choices):
        call = {"index": 0, "id": f"call_{i}", "type": "function",
                "function": {"name": "get_weather", "arguments": ""}}  # fmt: skip
        timed.append((STEP * 8, delta(i, tool_calls=[call])))
        for step, piece in ((20, '{"city": '), (30, '"Paris"')):
            timed.append((STEP * step, delta(i, tool_calls=[{"index": 0, "function":
                                                              {"arguments": piece}}])))  # fmt: skip
    timed += [(STEP * 40, held_finish(i, "length")) for i in range(choices)]
    return [*sorted(timed, key=lambda read: read[0]), (STEP * 40, DONE)]


def test_chunks_counted_where_a_call_was_forced_give_no_time_per_token() -> None:
    """n=2, no usage (the proxy asks for none with n > 1): the chunks count 4 of each
    choice's 40 tokens, so a span of 32 steps over 3 would be a TPOT 13 times too slow
    (the review's real vLLM: 15 to 30 times). The count and TTFT stay."""
    for n in (2, 1):
        m = replay(CHAT, {**body(n, tools=True, usage=False), "tool_choice": "required"},
                   required_calls(n))  # fmt: skip
        assert (m.output_tokens, m.token_source) == (4 * n, TokenSource.CHUNKS), n
        assert (m.tpot, m.decode_tokens_per_second) == (None, None), n
        assert m.ttft == STEP * 8, n


def held_answer() -> list[tuple[float, bytes]]:
    """Text, then a `<tool_call>` the hermes parser kept (no chunks) until `length`."""
    timed = [(STEP, delta(0, role="assistant", content=""))]
    timed += [(STEP * step, delta(0, content=f" w{step}")) for step in (1, 2, 3)]
    return [*timed, (STEP * 40, held_finish(0, "length")), (STEP * 40, DONE)]


def test_chunks_counted_where_tools_were_offered_give_no_time_per_token() -> None:
    """One choice, no usage: the chunks cannot tell the text's own last steps from a call
    the parser held. Without tools offered no parser holds a call, and the span over the
    chunks' count stands (3 text chunks and the finish's, the last at step 40)."""
    offered = replay(CHAT, body(tools=True, usage=False), held_answer())
    assert (offered.output_tokens, offered.token_source) == (4, TokenSource.CHUNKS)
    assert (offered.tpot, offered.decode_tokens_per_second) == (None, None)
    alone = replay(CHAT, body(usage=False), held_answer())
    assert (alone.output_tokens, alone.tpot) == (4, (STEP * 40 - STEP) / 3)


def text_then_call() -> list[tuple[float, bytes]]:
    """Text at steps 1 to 3, then the hermes parser keeps `<tool_call>` and the JSON before
    the name (no chunks) until the name at step 12; the arguments at 13, `length` at 14."""
    timed = [(STEP, delta(0, role="assistant", content=""))]
    timed += [(STEP * step, delta(0, content=f" w{step}")) for step in (1, 2, 3)]
    call = {"index": 0, "id": "call_0", "type": "function",
            "function": {"name": "get_weather", "arguments": ""}}  # fmt: skip
    timed += [(STEP * 12, delta(0, tool_calls=[call])),
              (STEP * 13, delta(0, tool_calls=[{"index": 0, "function": {"arguments": "{}"}}])),
              (STEP * 14, held_finish(0, "length")), (STEP * 14, DONE)]  # fmt: skip
    return timed


def test_a_tokenizer_s_count_where_a_call_came_gives_no_time_per_token(
    tmp_path: Path,
) -> None:
    """A tokenizer counts the texts that streamed: its span ends at the last content, but
    holds the tokens kept between the text and the call, which it cannot count. The same
    text without tools (no parser to hold any) keeps its figure."""
    counter = loaded_counter(tmp_path)
    try:
        called = replay(CHAT, body(tools=True, usage=False), text_then_call(), counter)
        alone = replay(CHAT, body(usage=False), held_answer(), counter)
    finally:
        counter.close()
    assert called.token_source is TokenSource.TOKENIZER
    assert (called.tpot, called.decode_tokens_per_second) == (None, None)
    assert alone.token_source is TokenSource.TOKENIZER and alone.tpot is not None
