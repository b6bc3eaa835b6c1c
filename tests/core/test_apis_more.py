"""The seams of the APIs added by issue 18 on real or source-faithful vLLM streams, fed with
synthetic read times (one read per event, and byte at a time): token-in/token-out generate,
audio transcription and translation, Cohere chat v2. Sources: tests/fixtures/streams/index.toml.
"""

from __future__ import annotations

import asyncio

import orjson

from proxy.core.apis import api_for
from proxy.core.measurement import ErrorType, Measurement, TokenSource
from proxy.core.observe import StreamObserver
from proxy.core.request import parse_request
from tests.core.test_apis import byte_at_a_time, events
from tests.paths import STREAMS

START, OPENED = 100.0, 100.125


def run(
    path: str, body: bytes, reads: list[bytes], times: list[float], end: float, **kw: object
) -> Measurement:
    info, _ = parse_request(path, body, **kw)  # type: ignore[arg-type]
    observer = StreamObserver(info, start=START)
    observer.open(200, "text/event-stream", OPENED)
    for chunk, now in zip(reads, times, strict=True):
        observer.feed(chunk, now)
    observer.end_of_stream(end)
    return asyncio.run(
        observer.finish(
            end=end, started_at=0.0, status_code=200, error_type=None, error_message=None
        )
    )


# -- /inference/v1/generate ---------------------------------------------------------------

GENERATE = orjson.dumps(
    {
        "model": "tiny",
        "stream": True,
        "token_ids": [1, 2, 3, 4, 5],
        "sampling_params": {"max_tokens": 5, "ignore_eos": True, "temperature": 0.5},
    }
)
GEN_TIMES = [100.5, 100.625, 100.75, 100.875, 101.0, 101.0]


def test_generate_route_has_its_api() -> None:
    api = api_for("/inference/v1/generate")
    assert api is not None and api.endpoint == "/inference/v1/generate"


def test_generate_request_reads_sampling_params_and_the_prompt_ids() -> None:
    info, _ = parse_request("/inference/v1/generate", GENERATE)
    assert (info.model, info.stream, info.max_tokens, info.temperature) == ("tiny", True, 5, 0.5)
    assert info.prompt_tokens == 5 and not info.usage_requested


def test_generate_stream_counts_output_exactly_from_token_ids() -> None:
    m = run("/inference/v1/generate", GENERATE, events("vllm032_generate.sse"), GEN_TIMES, 101.125)
    assert m.ok and m.ttft == 0.5  # the first chunk with token_ids
    assert (m.prompt_tokens, m.output_tokens, m.token_source) == (5, 5, TokenSource.TOKEN_IDS)
    assert (m.finish_reason, m.raw_finish_reason) == ("length", "length")
    assert m.tpot == 0.5 / 4 and m.content_events == 5
    assert m.response_id == "generate-tokens-94e2b1d16869bb0b"


def test_generate_stream_byte_at_a_time_gives_the_same_record() -> None:
    whole = run("/inference/v1/generate", GENERATE, events("vllm032_generate.sse"), GEN_TIMES, 102)
    reads, times = byte_at_a_time(events("vllm032_generate.sse"), GEN_TIMES)
    assert run("/inference/v1/generate", GENERATE, reads, times, 102) == whole


def test_generate_several_ids_in_one_chunk_count_each() -> None:
    chunk = (
        b'data: {"request_id":"r","usage":null,"output_mode":"tokens","choices":[{"index":0,'
        b'"finish_reason":"stop","stop_reason":null,"token_ids":[7,8,9]}]}\n\ndata: [DONE]\n\n'
    )
    m = run("/inference/v1/generate", GENERATE, [chunk], [100.5], 100.5)
    assert (m.output_tokens, m.content_events, m.finish_reason) == (3, 1, "stop")


def test_generate_asked_usage_wins_over_token_ids() -> None:
    usage = (
        b'data: {"request_id":"r","choices":[],"usage":{"prompt_tokens":6,"total_tokens":11,'
        b'"completion_tokens":5},"output_mode":"tokens"}\n\n'
    )
    reads = events("vllm032_generate.sse")
    m = run(
        "/inference/v1/generate",
        GENERATE,
        [*reads[:-1], usage, reads[-1]],
        [*GEN_TIMES[:-1], 101, 101],
        101,
    )
    assert (m.prompt_tokens, m.output_tokens, m.token_source) == (6, 5, TokenSource.USAGE)


def test_generate_error_after_the_200_is_a_stream_error() -> None:
    error = b'data: {"error":{"message":"boom","type":"InternalServerError","code":500}}\n\n'
    reads = events("vllm032_generate.sse")
    m = run(
        "/inference/v1/generate",
        GENERATE,
        [reads[0], error, reads[-1]],
        [100.5, 100.6, 100.6],
        100.7,
    )
    assert m.error_type is ErrorType.STREAM_ERROR and m.output_tokens == 1


def test_generate_cut_before_finish_is_truncated() -> None:
    reads = events("vllm032_generate.sse")[:2]
    m = run("/inference/v1/generate", GENERATE, reads, [100.5, 100.625], 100.7)
    assert m.error_type is ErrorType.STREAM_TRUNCATED and m.output_tokens == 2


def test_generate_non_streaming_body() -> None:
    info, _ = parse_request(
        "/inference/v1/generate", GENERATE.replace(b'"stream":true', b'"stream":false')
    )
    observer = StreamObserver(info, start=START)
    observer.open(200, "application/json", OPENED)
    observer.feed((STREAMS / "vllm032_generate.json").read_bytes(), 101.0)
    m = asyncio.run(
        observer.finish(
            end=101.0, started_at=0.0, status_code=200, error_type=None, error_message=None
        )
    )
    assert (m.prompt_tokens, m.output_tokens, m.token_source) == (5, 5, TokenSource.USAGE)
    assert m.finish_reason == "length" and m.response_id == "generate-tokens-a273b8ba44e5e549"
