"""Each API seam on recorded vLLM-shaped streams, fed with synthetic read times (one read
per event, and byte at a time), compared with the exact record it must give.

Fixtures (tests/fixtures/streams/) follow vLLM's own writers, field for field:
vllm_messages*.sse from vllm-project/vllm vllm/entrypoints/anthropic/serving.py
(message_stream_converter; `ping` is Anthropic's own and is included so it is seen to be
no token), vllm_responses*.sse from vllm/entrypoints/openai/responses/serving.py and
simple_streaming_events.py with openai-python's Response object fields.
Times are multiples of 1/8 s, exact in binary, so durations compare with `==`.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import orjson
import pytest

from proxy.core.apis import APIS, ENDPOINTS, api_for
from proxy.core.apis.messages import STOP_REASONS
from proxy.core.measurement import NONE_LABEL, ErrorType, Measurement, TokenSource
from proxy.core.observe import StreamObserver
from proxy.core.request import RequestInfo, parse_request
from tests.paths import STREAMS

START, OPENED, STARTED_AT = 100.0, 100.125, 1_718_000_000.0
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def events(name: str) -> list[bytes]:
    raw = (STREAMS / name).read_bytes()
    parts = raw.split(b"\n\n")
    reads = [p + b"\n\n" for p in parts[:-1]]
    return [*reads, parts[-1]] if parts[-1] else reads


def info(endpoint: str, stream: bool = True) -> RequestInfo:
    return RequestInfo(endpoint, MODEL, stream, True, 256, 0.7)


def finish(observer: StreamObserver, end: float, status: int = 200) -> Measurement:
    observer.end_of_stream(end)
    return asyncio.run(
        observer.finish(
            end=end, started_at=STARTED_AT, status_code=status, error_type=None, error_message=None
        )
    )


def replay(endpoint: str, reads: list[bytes], times: list[float], end: float) -> Measurement:
    assert len(reads) == len(times)
    observer = StreamObserver(info(endpoint), start=START)
    observer.open(200, "text/event-stream; charset=utf-8", OPENED)
    for chunk, now in zip(reads, times, strict=True):
        observer.feed(chunk, now)
    return finish(observer, end)


def byte_at_a_time(reads: list[bytes], times: list[float]) -> tuple[list[bytes], list[float]]:
    """Every byte its own read, at the time of the event it belongs to."""
    out_reads, out_times = [], []
    for chunk, now in zip(reads, times, strict=True):
        out_reads += [chunk[i : i + 1] for i in range(len(chunk))]
        out_times += [now] * len(chunk)
    return out_reads, out_times


def record(endpoint: str, response_id: str, **fields: object) -> Measurement:
    base = Measurement(
        endpoint=endpoint,
        model=MODEL,
        stream=True,
        stream_requested=True,
        status_code=200,
        started_at=STARTED_AT,
        ttfb=0.125,
        ttft=None,
        tpot=None,
        decode_tokens_per_second=None,
        e2e=0.0,
        inter_token_latencies=(),
        prompt_tokens=None,
        output_tokens=None,
        cached_prompt_tokens=None,
        token_source=TokenSource.CHUNKS,
        content_events=0,
        finish_reason=NONE_LABEL,
        error_type=None,
        response_id=response_id,
        response_model=MODEL,
        max_tokens=256,
        temperature=0.7,
    )
    return replace(base, **fields)  # type: ignore[arg-type]


# -- the registry -------------------------------------------------------------------------


def test_every_vllm_route_has_its_api_and_label() -> None:
    labels = {
        "/v1/chat/completions": "/v1/chat/completions",
        "/v1/completions": "/v1/completions",
        "/v1/messages": "/v1/messages",
        "/v1/responses": "/v1/responses",
        "/v1/embeddings": "/v1/embeddings",
        "/pooling": "/pooling",
        "/score": "/score",
        "/v1/score": "/score",
        "/rerank": "/rerank",
        "/v1/rerank": "/rerank",
        "/v2/rerank": "/rerank",
        "/classify": "/classify",
        "/v1/classify": "/classify",
        "/inference/v1/generate": "/inference/v1/generate",
        "/v1/audio/transcriptions": "/v1/audio/transcriptions",
        "/v1/audio/translations": "/v1/audio/translations",
        "/cohere/v2/chat": "/cohere/v2/chat",
        "/v2/embed": "/v2/embed",  # vllm/entrypoints/pooling/embed/api_router.py
        # vllm/entrypoints/openai/chat_completion/batch_serving.py
        "/v1/chat/completions/batch": "/v1/chat/completions/batch",
        # SageMaker's (vllm/entrypoints/serve/sagemaker/api_router.py): a body is labelled
        # with the API that serves it (proxy/core/apis/invocations.py); only a body no API
        # takes keeps this label
        "/invocations": "/invocations",
        # Ollama's native API (ollama/ollama server/routes.go)
        "/api/chat": "/api/chat",
        "/api/generate": "/api/generate",
        "/api/embed": "/api/embed",
        # llama.cpp's llama-server (tools/server/server.cpp): its native completion (also
        # at /completions), and OpenAI's chat without its /v1
        "/completion": "/completion",
        "/completions": "/completion",
        "/chat/completions": "/v1/chat/completions",
        "/reranking": "/rerank",  # the same handler as /rerank
        "/v1/reranking": "/rerank",
        # vLLM's label reads (vllm/entrypoints/generate/generative_scoring/, structured_decisions/)
        "/generative_scoring": "/generative_scoring",
        "/v1/systemone": "/v1/systemone",
    }
    for path, label in labels.items():
        api = api_for(path)
        assert api is not None and api.endpoint == label, path
    assert set(labels.values()) == ENDPOINTS
    for path in (
        "/v1/messages/count_tokens",
        "/tokenize",
        "/v1/models",
        "/v1/responses/x",
        "/api/version",
        "/api/tags",
    ):
        assert api_for(path) is None, path


def test_each_label_is_one_of_its_own_paths() -> None:
    for api in APIS:
        assert api.paths[0] == api.endpoint and api.measures, api


# -- Anthropic Messages -------------------------------------------------------------------

MSG_ID = "chatcmpl-5f0c7d9e2b8a4c61"
# message_start, ping, block start, thinking, signature, block stop, block start, empty
# text, "Hello", " there", "!", block stop, message_delta, message_stop
MSG_TIMES = [100.125, 100.125, 100.125, 100.5, 100.5, 100.5, 100.5, 100.5,
             100.75, 101.0, 101.25, 101.25, 101.375, 101.375]  # fmt: skip
MSG_WANT = record(
    "/v1/messages",
    MSG_ID,
    ttft=0.5,  # the thinking delta; not message_start, ping or the block starts at 0.125
    inter_token_latencies=(0.25, 0.25, 0.25),
    # (message_delta's read, the EOS's - first) / (5 output tokens from message_delta - 1)
    tpot=0.875 / 4,
    decode_tokens_per_second=4 / 0.875,
    e2e=1.5,
    prompt_tokens=12,
    output_tokens=5,
    token_source=TokenSource.USAGE,
    content_events=4,
    finish_reason="stop",
    raw_finish_reason="end_turn",
    first_reasoning=0.5,  # the thinking delta
    last_reasoning=0.5,
    first_answer=0.75,  # "Hello": the empty text delta at 0.5 is no answer
    reasoning_events=1,
    reasoning_tokens=1,  # Messages usage has no reasoning count: one per thinking event
    reasoning_token_source="events",
    answer_tpot=0.625 / 3,  # (101.375, the EOS - 100.75) / (5 output - 1 reasoning - 1)
)


def test_messages_stream_gives_exact_record() -> None:
    assert replay("/v1/messages", events("vllm_messages.sse"), MSG_TIMES, 101.5) == MSG_WANT


def test_messages_stream_byte_at_a_time_gives_the_same_record() -> None:
    reads, times = byte_at_a_time(events("vllm_messages.sse"), MSG_TIMES)
    assert replay("/v1/messages", reads, times, 101.5) == MSG_WANT


# vLLM 0.32.0's own Messages stream, captured (tests/fixtures/streams/vllm-0.32/README.md):
# message_start, content_block_start, six text deltas, block stop, message_delta (stop_reason
# max_tokens, usage 23 in / 6 out), message_stop; one read per event, an eighth apart.
V032_MSG_TIMES = [100.125 + i / 8 for i in range(11)]
V032_MSG_WANT = record(
    "/v1/messages",
    "chatcmpl-802149480cbad842",
    ttft=0.375,  # the first text delta: not message_start (0.125) or the block start (0.25)
    inter_token_latencies=(0.125,) * 5,
    tpot=0.625 / 5,  # (last - first text delta) / (6 output tokens from message_delta - 1)
    decode_tokens_per_second=5 / 0.625,
    e2e=1.375,
    prompt_tokens=23,
    output_tokens=6,
    token_source=TokenSource.USAGE,
    content_events=6,
    finish_reason="length",
    raw_finish_reason="max_tokens",
    first_answer=0.375,
    response_model="tiny",
)


def test_a_real_vllm_032_messages_stream_gives_its_exact_record() -> None:
    reads = events("vllm-0.32/messages_stream.sse")
    assert len(reads) == len(V032_MSG_TIMES)
    assert replay("/v1/messages", reads, V032_MSG_TIMES, 101.375) == V032_MSG_WANT
    bytewise, times = byte_at_a_time(reads, V032_MSG_TIMES)
    assert replay("/v1/messages", bytewise, times, 101.375) == V032_MSG_WANT


def test_messages_start_events_at_t0_are_not_the_first_token() -> None:
    reads = events("vllm_messages.sse")[:3]  # message_start, ping, content_block_start
    m = replay("/v1/messages", reads, [100.125] * 3, 100.25)
    assert (m.ttft, m.content_events) == (None, 0)


def test_messages_without_message_stop_is_truncated() -> None:
    reads = events("vllm_messages.sse")[:-1]
    m = replay("/v1/messages", reads, MSG_TIMES[:-1], 101.5)
    assert m.error_type is ErrorType.STREAM_TRUNCATED
    assert m.error_message == "stream ended without message_stop"


def test_messages_cut_before_message_delta_does_not_count_output_as_zero() -> None:
    reads = events("vllm_messages.sse")[:11]
    m = replay("/v1/messages", reads, MSG_TIMES[:11], 101.5)
    assert m.error_type is ErrorType.STREAM_TRUNCATED
    assert (m.output_tokens, m.token_source) == (4, TokenSource.CHUNKS)
    assert m.prompt_tokens == 12  # message_start's input_tokens, known before the cut


def test_a_chat_stream_cut_before_its_usage_keeps_its_prompt_unknown() -> None:
    reads = [_chunk(0, "a"), _chunk(0, "b")]
    m = replay("/v1/chat/completions", reads, [100.5, 100.75], 101.0)
    assert (m.prompt_tokens, m.output_tokens, m.token_source) == (None, 2, TokenSource.CHUNKS)


def test_messages_done_after_the_stop_is_no_malformed_event() -> None:
    """vLLM's converter has sent `data: [DONE]` after its error events (anthropic/serving.py
    @ 82df3f49): nothing to count, and never a malformed event."""
    reads = [*events("vllm_messages.sse"), b"data: [DONE]\n\n"]
    times = [*MSG_TIMES, MSG_TIMES[-1]]
    m = replay("/v1/messages", reads, times, 101.25)
    assert m.malformed_events == 0 and m.error_type is None


def test_messages_error_event_is_a_stream_error() -> None:
    reads = events("vllm_messages_error.sse")
    m = replay("/v1/messages", reads, [100.125, 100.125, 100.5, 100.75], 101.0)
    assert (m.error_type, m.error_message) == (
        ErrorType.STREAM_ERROR,
        "Invalid data format received",
    )
    assert m.ttft == 0.5


@pytest.mark.parametrize(
    ("raw", "label"),
    [*STOP_REASONS.items(), ("pause_turn", "other"), ("compaction", "other")],
)
def test_messages_stop_reasons_map_onto_the_closed_set(raw: str, label: str) -> None:
    assert api_for("/v1/messages").finish_label(raw) == label  # type: ignore[union-attr]


def test_messages_stop_reason_table() -> None:
    assert STOP_REASONS == {
        "end_turn": "stop",
        "stop_sequence": "stop",
        "max_tokens": "length",
        "model_context_window_exceeded": "length",
        "tool_use": "tool_calls",
        "refusal": "content_filter",
    }


def test_messages_usage_counts_cache_reads_as_cached_and_in_the_prompt() -> None:
    body = orjson.dumps(
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": MODEL,
            "content": [{"type": "text", "text": "Hi"}],
            "stop_reason": "max_tokens",
            "usage": {
                "input_tokens": 10,
                "cache_read_input_tokens": 30,
                "cache_creation_input_tokens": 2,
                "output_tokens": 7,
            },
        }
    )
    observer = StreamObserver(info("/v1/messages", stream=False), start=START)
    observer.open(200, "application/json", OPENED)
    observer.feed(body, 100.5)
    m = finish(observer, 100.5)
    assert (m.prompt_tokens, m.cached_prompt_tokens, m.output_tokens) == (42, 30, 7)
    assert (m.finish_reason, m.raw_finish_reason, m.response_id) == (
        "length",
        "max_tokens",
        "msg_1",
    )


def test_messages_request_reads_max_tokens_and_system() -> None:
    body = orjson.dumps(
        {
            "model": "m",
            "system": "Be brief.",
            "max_tokens": 64,
            "stream": True,
            "messages": [{"role": "user", "content": "Hi"}],
        }
    )
    request, _ = parse_request("/v1/messages", body)
    assert (request.endpoint, request.max_tokens, request.stream) == ("/v1/messages", 64, True)
    assert request.usage_requested  # Messages streams always carry usage
    assert request.prompt[0] == {"role": "system", "content": "Be brief."}


# -- OpenAI Responses ---------------------------------------------------------------------

RESP_ID = "resp_3b9d0f6a1c2e4f58"
# created, in_progress, output_item.added, content_part.added, 3 deltas, text.done, end
RESP_TIMES = [100.125, 100.125, 100.125, 100.125, 100.5, 100.75, 101.0, 101.0, 101.125]
RESP_WANT = record(
    "/v1/responses",
    RESP_ID,
    ttft=0.5,  # the first output_text.delta, not response.created at 0.125
    inter_token_latencies=(0.25, 0.25),
    # 3 text deltas and the EOS (usage counts it), whose step response.completed ends:
    # (101.125 - 100.5) / (4 - 1)
    tpot=0.625 / 3,
    decode_tokens_per_second=3 / 0.625,
    e2e=1.25,
    prompt_tokens=12,
    output_tokens=4,
    cached_prompt_tokens=8,
    token_source=TokenSource.USAGE,
    content_events=3,
    finish_reason="stop",
    raw_finish_reason="completed",
    first_answer=0.5,
)


def test_responses_stream_gives_exact_record() -> None:
    assert replay("/v1/responses", events("vllm_responses.sse"), RESP_TIMES, 101.25) == RESP_WANT


def test_responses_stream_byte_at_a_time_gives_the_same_record() -> None:
    reads, times = byte_at_a_time(events("vllm_responses.sse"), RESP_TIMES)
    assert replay("/v1/responses", reads, times, 101.25) == RESP_WANT


@pytest.mark.parametrize(
    "kind", ["response.code_interpreter_call_code.delta", "response.mcp_call_arguments.delta"]
)
def test_a_built_in_tools_input_is_the_first_token(kind: str) -> None:
    """A harmony model writes a code interpreter's code or an MCP call's arguments as
    deltas of their own (vLLM's responses/serving.py emits both): generated content, of the
    tool kind, though no function call is counted."""

    def event(obj: dict[str, object]) -> bytes:
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    reads = [
        event({"type": "response.created", "response": {"id": RESP_ID, "model": MODEL}}),
        event({"type": "response.output_item.added", "output_index": 0,
               "item": {"type": "code_interpreter_call", "id": "ci_1"}}),
        event({"type": kind, "output_index": 0, "delta": "fib("}),
        event({"type": kind, "output_index": 0, "delta": "30)"}),
        event({"type": "response.output_text.delta", "output_index": 1, "delta": "832040"}),
    ]  # fmt: skip
    m = replay("/v1/responses", reads, [100.25, 100.5, 100.75, 101.0, 101.5], 101.5)
    assert (m.ttft, m.first_tool_call, m.first_answer) == (0.75, 0.75, 1.5)
    assert m.content_events == 3 and m.tool_calls == ()


def test_responses_incomplete_for_max_output_tokens_is_length() -> None:
    m = replay("/v1/responses", events("vllm_responses_incomplete.sse"), RESP_TIMES, 101.25)
    # 3 tokens and no EOS: a length finish is no token of its own, so the span ends at
    # the last delta (100.5 to 101.0), not at response.incomplete's read
    length = replace(RESP_WANT, output_tokens=3, tpot=0.25, decode_tokens_per_second=4.0)
    assert m == replace(length, finish_reason="length", raw_finish_reason="max_output_tokens")


def test_a_background_responses_acknowledgement_has_no_finish_reason() -> None:
    """`background: true`, not streamed: vLLM answers at once with `status: "queued"` and
    `usage: null`, and generates later (openai/responses/serving.py). It was recorded
    as finished for an unknown reason ("other"); nothing has finished yet."""
    api = api_for("/v1/responses")
    assert api is not None
    observer = StreamObserver(info(api.endpoint, stream=False), start=START)
    observer.open(200, "application/json", OPENED)
    queued = {"id": "resp_1", "model": MODEL, "status": "queued", "output": [], "usage": None}
    observer.feed(orjson.dumps(queued), 100.5)
    m = finish(observer, 100.5)
    assert (m.ok, m.finish_reason, m.raw_finish_reason) == (True, NONE_LABEL, "queued")
    assert (m.output_tokens, m.token_source) == (None, TokenSource.NONE)


def test_responses_failed_is_a_stream_error() -> None:
    m = replay("/v1/responses", events("vllm_responses_failed.sse"), RESP_TIMES, 101.25)
    assert (m.error_type, m.error_message) == (ErrorType.STREAM_ERROR, "engine died")
    assert m.finish_reason == "error"


def test_responses_error_event_is_a_stream_error() -> None:
    reads = events("vllm_responses.sse")[:5]
    reads.append(b'event: error\ndata: {"type":"error","code":"x","message":"boom"}\n\n')
    m = replay("/v1/responses", reads, RESP_TIMES[:6], 101.25)
    assert (m.error_type, m.error_message) == (ErrorType.STREAM_ERROR, "boom")


def test_responses_without_completed_is_truncated() -> None:
    m = replay("/v1/responses", events("vllm_responses.sse")[:-1], RESP_TIMES[:-1], 101.25)
    assert m.error_type is ErrorType.STREAM_TRUNCATED


def test_responses_non_streaming_body() -> None:
    stream = events("vllm_responses.sse")[-1]
    response = orjson.loads(stream.split(b"data: ", 1)[1])["response"]
    observer = StreamObserver(info("/v1/responses", stream=False), start=START)
    observer.open(200, "application/json", OPENED)
    observer.feed(orjson.dumps(response), 100.5)
    m = finish(observer, 100.5)
    assert (m.prompt_tokens, m.output_tokens, m.cached_prompt_tokens) == (12, 4, 8)
    assert (m.finish_reason, m.response_id, m.ttft) == ("stop", RESP_ID, None)


def test_responses_request_reads_max_output_tokens() -> None:
    body = orjson.dumps({"model": "m", "input": "Hi", "max_output_tokens": 32, "stream": True})
    request, _ = parse_request("/v1/responses", body)
    user = [{"role": "user", "content": "Hi"}]  # the text input as vLLM makes it a message
    assert (request.max_tokens, request.prompt, request.usage_requested) == (32, user, True)


# -- non-generative -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "usage"),
    [
        ("/v1/embeddings", {"prompt_tokens": 9, "total_tokens": 9}),
        ("/pooling", {"prompt_tokens": 9, "total_tokens": 9}),
        ("/v2/rerank", {"total_tokens": 9}),
    ],
)
def test_non_generative_body_gives_prompt_tokens_only(path: str, usage: dict[str, int]) -> None:
    api = api_for(path)
    assert api is not None and not api.generative
    observer = StreamObserver(info(api.endpoint, stream=False), start=START)
    observer.open(200, "application/json", OPENED)
    observer.feed(orjson.dumps({"id": "embd-1", "model": MODEL, "data": [], "usage": usage}), 100.5)
    m = finish(observer, 100.5)
    assert (m.prompt_tokens, m.output_tokens, m.token_source) == (9, None, TokenSource.USAGE)
    assert (m.ttft, m.finish_reason, m.endpoint) == (None, NONE_LABEL, api.endpoint)


def test_cohere_embed_counts_its_prompt_from_meta_billed_units() -> None:
    """vLLM's /v2/embed answers CohereEmbedResponse (pooling/embed/protocol.py): no
    `usage`, the pooled count split into meta.billed_units' input and image tokens. It
    went through unmeasured, counted as a passthrough on the `/other` route."""
    api = api_for("/v2/embed")
    assert api is not None and not api.generative and api.endpoint == "/v2/embed"
    request, _ = parse_request(
        "/v2/embed", orjson.dumps({"model": MODEL, "texts": ["hi", "there"], "max_tokens": 5})
    )
    assert (request.prompt, request.max_tokens) == (["hi", "there"], None)  # an input cap
    observer = StreamObserver(info(api.endpoint, stream=False), start=START)
    observer.open(200, "application/json", OPENED)
    answer = {
        "id": "embd-1",
        "embeddings": {"float": [[0.1], [0.2]]},
        "texts": ["hi", "there"],
        "meta": {
            "api_version": {"version": "2"},
            "billed_units": {"input_tokens": 8, "image_tokens": 0},
        },
        "response_type": "embeddings_by_type",
    }
    observer.feed(orjson.dumps(answer), 100.5)
    m = finish(observer, 100.5)
    assert (m.prompt_tokens, m.output_tokens, m.token_source) == (8, None, TokenSource.USAGE)
    assert (m.ok, m.response_id) == (True, "embd-1")


# -- n > 1 choices (issue 12, defect 6) ---------------------------------------------------


def _chunk(index: int, text: str, finish: str | None = None) -> bytes:
    choice = {"index": index, "delta": {"content": text}, "finish_reason": finish}
    return b"data: " + orjson.dumps({"id": "c", "model": MODEL, "choices": [choice]}) + b"\n\n"


def test_n_choices_are_timed_per_choice_and_the_median_choice_is_reported() -> None:
    # Three choices of 5 tokens each, interleaved; spans 1.0 s, 2.0 s and 0.5 s.
    spans = {0: 1.0, 1: 2.0, 2: 0.5}
    timed: list[tuple[float, bytes]] = []
    for index, span in spans.items():
        for k in range(5):
            timed.append((100.5 + index / 16 + k * span / 4, _chunk(index, "x")))
    timed.sort(key=lambda t: t[0])
    usage = {"prompt_tokens": 4, "completion_tokens": 15}
    tail = b"data: " + orjson.dumps({"id": "c", "choices": [], "usage": usage}) + b"\n\n"
    reads = [chunk for _, chunk in timed] + [tail, b"data: [DONE]\n\n"]
    times = [t for t, _ in timed] + [103.0, 103.0]
    m = replay("/v1/chat/completions", reads, times, 103.0)
    assert m.ttft == 0.5  # the first content of any choice
    assert m.tpot == 0.25 and m.decode_tokens_per_second == 4.0  # choice 0: the median
    assert sorted(m.inter_token_latencies) == sorted([0.25] * 4 + [0.5] * 4 + [0.125] * 4)
    assert (m.output_tokens, m.content_events) == (15, 15)


def _finish_only(index: int, finish: str) -> bytes:
    choice = {"index": index, "delta": {}, "finish_reason": finish}
    return b"data: " + orjson.dumps({"id": "c", "model": MODEL, "choices": [choice]}) + b"\n\n"


def test_n_choices_keep_each_ones_finish_reason_in_index_order() -> None:
    """vLLM ends each choice of n > 1 with its own finish chunk (delta {}): the record keeps
    one finish label per choice, in index order, where it kept the last one seen alone;
    a choice that streamed and never finished is `none`."""
    reads = [
        _chunk(1, "a"),
        _chunk(0, "b"),
        _chunk(2, "c"),
        _finish_only(1, "length"),
        _finish_only(0, "stop"),
        b"data: [DONE]\n\n",
    ]
    m = replay("/v1/chat/completions", reads, [100.5 + i / 8 for i in range(6)], 101.5)
    assert m.finish_reasons == ("stop", "length", NONE_LABEL)
    one = replay("/v1/chat/completions", [_chunk(0, "a", "stop")], [100.5], 100.5)
    assert (one.finish_reason, one.finish_reasons) == ("stop", ())


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_a_non_streaming_body_keeps_each_choices_finish_reason_in_index_order(
    endpoint: str,
) -> None:
    """A body ends every choice at once: with n > 1 each one's finish label is kept, in
    index order, as a stream's are (one position once: the last choice's alone)."""
    key, value = ("message", {"role": "assistant", "content": "a"}), ("text", "a")
    field = key if endpoint == "/v1/chat/completions" else value
    choices = [
        {"index": 1, field[0]: field[1], "finish_reason": "length"},
        {"index": 0, field[0]: field[1], "finish_reason": "stop"},
    ]
    body = {"id": "c", "model": MODEL, "choices": choices}
    observer = StreamObserver(info(endpoint, stream=False), start=START)
    observer.open(200, "application/json", OPENED)
    observer.feed(orjson.dumps(body), 100.5)
    m = finish(observer, 100.5)
    assert m.finish_reasons == ("stop", "length")
    one = {**body, "choices": choices[:1]}
    observer = StreamObserver(info(endpoint, stream=False), start=START)
    observer.open(200, "application/json", OPENED)
    observer.feed(orjson.dumps(one), 100.5)
    m = finish(observer, 100.5)
    assert (m.finish_reason, m.finish_reasons) == ("length", ())


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_n_choices_cut_after_one_finished_is_truncated(endpoint: str) -> None:
    """Without [DONE] a finish reason ends a stream (OpenAI may omit [DONE]), but with
    n > 1 each choice finishes alone: the stream ended cleanly only once every choice that
    streamed has finished."""
    if endpoint == "/v1/completions":
        pieces = [b'{"index":1,"text":"a","finish_reason":null}',
                  b'{"index":0,"text":"b","finish_reason":null}',
                  b'{"index":0,"text":"","finish_reason":"stop"}',
                  b'{"index":1,"text":"","finish_reason":"length"}']  # fmt: skip
        reads = [b'data: {"id":"c","choices":[' + p + b"]}\n\n" for p in pieces]
    else:
        reads = [_chunk(1, "a"), _chunk(0, "b"), _finish_only(0, "stop"), _finish_only(1, "length")]
    times = [100.5 + i / 8 for i in range(4)]
    cut = replay(endpoint, reads[:3], times[:3], 101.0)
    assert cut.error_type is ErrorType.STREAM_TRUNCATED
    whole = replay(endpoint, reads, times, 101.0)
    assert whole.error_type is None and whole.finish_reasons == ("stop", "length")


def test_one_choice_keeps_the_request_level_formula() -> None:
    reads = [_chunk(0, "a"), _chunk(0, "b"), _chunk(0, "c", "stop")]
    m = replay("/v1/chat/completions", reads, [100.5, 100.75, 101.5], 101.5)
    assert (m.tpot, m.decode_tokens_per_second, m.token_source) == (0.5, 2.0, TokenSource.CHUNKS)


def test_unknown_chat_finish_reason_is_other_with_the_raw_value_kept() -> None:
    m = replay("/v1/chat/completions", [_chunk(0, "a", "eos_token")], [100.5], 100.5)
    assert (m.finish_reason, m.raw_finish_reason) == ("other", "eos_token")


def test_llama_server_s_bare_error_object_in_a_messages_stream_is_a_stream_error() -> None:
    """llama-server ends a Messages stream that failed with `event: error` and its bare
    error object as the data, no `"type": "error"` envelope (tools/server: the streaming
    lambda's format_anthropic_sse({{"event", "error"}, {"data", res_json}}))."""
    start, *_ = events("vllm_messages.sse")
    failed = (
        b'event: error\ndata: {"code":500,"message":"the slot failed","type":"server_error"}\n\n'
    )
    m = replay("/v1/messages", [start, failed], [100.125, 100.5], 101.0)
    assert (m.error_type, m.error_message) == (ErrorType.STREAM_ERROR, "the slot failed")
