"""Prompt tokens written to the prefix cache, and the backend's system_fingerprint, on the
record: each read from the event or body that carries usage (or, for the fingerprint
without usage, the finish), in each API's own field, None where the backend says nothing.

The answers are real vLLM 0.32 ones: with --enable-prompt-tokens-details
(tests/fixtures/streams/vllm-0.32-cache/README.md), and without it (vllm-0.32/README.md).
"""

from __future__ import annotations

import orjson
import pytest

from proxy.core.apis import api_for
from proxy.core.apis.base import MAX_FINGERPRINT
from proxy.core.measurement import ErrorType, Measurement, TokenSource
from proxy.core.observe import StreamObserver
from tests.core.test_apis import OPENED, START, byte_at_a_time, events, finish, info, replay
from tests.paths import STREAMS

CACHE = "vllm-0.32-cache/"
PLAIN = "vllm-0.32/"
#: What the two servers said: the cache captures' and the plain captures'.
CACHE_FINGERPRINT = "vllm-0.32.0-51eb094b"
PLAIN_FINGERPRINT = "vllm-0.32.0-30e38e1f"


def streamed(endpoint: str, name: str) -> Measurement:
    """The record of a captured stream, one read per event an eighth apart; fed a byte at a
    time it must be the same record."""
    reads = events(name)
    times = [100.25 + i / 8 for i in range(len(reads))]
    m = replay(endpoint, reads, times, times[-1])
    assert replay(endpoint, *byte_at_a_time(reads, times), times[-1]) == m
    return m


def whole(endpoint: str, name: str) -> Measurement:
    observer = StreamObserver(info(endpoint, stream=False), start=START)
    observer.open(200, "application/json", OPENED)
    observer.feed((STREAMS / name).read_bytes(), 100.5)
    return finish(observer, 100.5)


@pytest.mark.parametrize(
    ("endpoint", "name", "counts"),
    [
        # (prompt, cached, written): chat's prompt_tokens_details.created_cache_tokens
        ("/v1/chat/completions", "chat_stream_cache_write.sse", (180, 0, 128)),
        ("/v1/chat/completions", "chat_stream_cache_read.sse", (180, 128, 0)),
        # Messages: input_tokens 57 + cache_creation_input_tokens 128 is the prompt
        ("/v1/messages", "messages_stream_cache_write.sse", (185, 0, 128)),
        ("/v1/messages", "messages_stream_cache_read.sse", (185, 128, 0)),
        # Responses: input_tokens_details.cache_write_tokens
        ("/v1/responses", "responses_stream_cache_write.sse", (195, 0, 128)),
        # legacy completions say cached_tokens alone: nothing written is known
        ("/v1/completions", "completions_stream_include_usage.sse", (149, 0, None)),
    ],
)
def test_a_stream_s_cache_writes_come_from_its_api_s_own_usage_field(
    endpoint: str, name: str, counts: tuple[int, int, int | None]
) -> None:
    m = streamed(endpoint, CACHE + name)
    assert (m.prompt_tokens, m.cached_prompt_tokens, m.cache_write_tokens) == counts
    assert (m.token_source, m.error_type) == (TokenSource.USAGE, None)


@pytest.mark.parametrize(
    ("endpoint", "name", "counts"),
    [
        ("/v1/chat/completions", "chat_nonstream_cache_read.json", (180, 128, 0)),
        ("/v1/responses", "responses_nonstream_cache_read.json", (195, 128, 0)),
        # `"created_cache_tokens":null`: not said, so not 0
        ("/v1/completions", "completions_nonstream_cache_read.json", (149, 128, None)),
    ],
)
def test_a_whole_answer_s_cache_writes_come_from_its_usage(
    endpoint: str, name: str, counts: tuple[int, int, int | None]
) -> None:
    m = whole(endpoint, CACHE + name)
    assert (m.prompt_tokens, m.cached_prompt_tokens, m.cache_write_tokens) == counts


def test_openai_s_own_name_for_a_chat_s_cache_writes_is_read_too() -> None:
    # OpenAI's chat usage: prompt_tokens_details.cache_write_tokens (openai-python 3.63,
    # types/completion_usage.py PromptTokensDetails); vLLM's created_cache_tokens first
    api = api_for("/v1/chat/completions")
    assert api is not None
    usage = {"prompt_tokens": 2048, "completion_tokens": 9, "total_tokens": 2057}
    openai_details = {"cached_tokens": 1024, "cache_write_tokens": 1024, "audio_tokens": 0}
    counts = api.counts({**usage, "prompt_tokens_details": openai_details})
    assert counts is not None and (counts.cached, counts.cache_write) == (1024, 1024)
    both = {"cached_tokens": 0, "created_cache_tokens": 128, "cache_write_tokens": 7}
    counts = api.counts({**usage, "prompt_tokens_details": both})
    assert counts is not None and counts.cache_write == 128


def test_without_the_prompt_details_nothing_is_said_of_the_cache() -> None:
    m = streamed("/v1/chat/completions", PLAIN + "chat_stream_include_usage.sse")
    assert (m.prompt_tokens, m.cached_prompt_tokens, m.cache_write_tokens) == (23, None, None)
    messages = streamed("/v1/messages", PLAIN + "messages_stream.sse")
    assert (messages.cached_prompt_tokens, messages.cache_write_tokens) == (None, None)


def test_a_messages_stream_cut_after_its_start_keeps_the_start_s_cache_writes() -> None:
    # Anthropic's own message_start carries the cache fields (vLLM's has none); with no
    # message_delta the output is the chunks' count and the prompt is the start's.
    start = orjson.dumps(
        {
            "type": "message_start",
            "message": {
                "id": "msg_1",
                "usage": {
                    "input_tokens": 10,
                    "cache_creation_input_tokens": 2,
                    "cache_read_input_tokens": 6,
                    "output_tokens": 0,
                },
            },
        }
    )
    delta = b'{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi"}}'
    reads = [b"data: " + start + b"\n\n", b"data: " + delta + b"\n\n"]
    m = replay("/v1/messages", reads, [100.25, 100.5], 100.75)
    assert m.error_type is ErrorType.STREAM_TRUNCATED
    assert (m.prompt_tokens, m.cached_prompt_tokens, m.cache_write_tokens) == (18, 6, 2)
    assert m.token_source is TokenSource.CHUNKS


@pytest.mark.parametrize(
    ("endpoint", "name"),
    [
        # vLLM stamps the terminal chunk when no usage chunk follows, else the usage chunk
        ("/v1/chat/completions", "chat_stream_no_usage.sse"),
        ("/v1/chat/completions", "chat_stream_include_usage.sse"),
        ("/v1/completions", "completions_stream_no_usage.sse"),
        ("/v1/completions", "completions_stream_include_usage.sse"),
    ],
)
def test_the_system_fingerprint_comes_from_the_terminal_or_the_usage_chunk(
    endpoint: str, name: str
) -> None:
    assert streamed(endpoint, PLAIN + name).system_fingerprint == PLAIN_FINGERPRINT


def test_a_whole_answer_s_system_fingerprint_is_kept() -> None:
    m = whole("/v1/chat/completions", PLAIN + "chat_nonstream_metrics.json")
    assert m.system_fingerprint == PLAIN_FINGERPRINT
    m = whole("/v1/completions", CACHE + "completions_nonstream_cache_read.json")
    assert m.system_fingerprint == CACHE_FINGERPRINT


def test_apis_without_a_system_fingerprint_have_none() -> None:
    assert (
        streamed("/v1/messages", CACHE + "messages_stream_cache_read.sse").system_fingerprint
        is None
    )
    response = whole("/v1/responses", CACHE + "responses_nonstream_cache_read.json")
    assert response.system_fingerprint is None


def test_a_null_system_fingerprint_is_none() -> None:
    # vLLM's --fingerprint-mode none: the whole answer says `"system_fingerprint":null`
    body = (STREAMS / CACHE / "chat_nonstream_cache_read.json").read_bytes()
    body = body.replace(f'"{CACHE_FINGERPRINT}"'.encode(), b"null")
    observer = StreamObserver(info("/v1/chat/completions", stream=False), start=START)
    observer.open(200, "application/json", OPENED)
    observer.feed(body, 100.5)
    m = finish(observer, 100.5)
    assert (m.system_fingerprint, m.cache_write_tokens) == (None, 0)


def test_a_system_fingerprint_past_its_bound_is_not_kept() -> None:
    # A broken or hostile backend's: it would go whole into every log line and span.
    body = (STREAMS / CACHE / "chat_nonstream_cache_read.json").read_bytes()
    for size, kept in ((MAX_FINGERPRINT, True), (MAX_FINGERPRINT + 1, False)):
        value = "f" * size
        observer = StreamObserver(info("/v1/chat/completions", stream=False), start=START)
        observer.open(200, "application/json", OPENED)
        observer.feed(body.replace(CACHE_FINGERPRINT.encode(), value.encode()), 100.5)
        assert finish(observer, 100.5).system_fingerprint == (value if kept else None)
