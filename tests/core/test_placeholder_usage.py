"""A usage object of 0 prompt and 0 completion tokens is a placeholder, no count.

Ollama's OpenAI layer, asked for include_usage, writes `"usage":{"prompt_tokens":0,
"completion_tokens":0,"total_tokens":0}` on every /v1/completions chunk
(ollama/ollama @ fb30760 middleware/openai.go CompleteWriter.writeResponse: `c.Usage =
&openai.Usage{}`) and the real one only on a chunk of its own after the done response. A
stream cut before that chunk was recorded with prompt 0 and output 0 from usage. No real
prompt is 0 tokens (vLLM 0.32 refuses an empty one: vllm/v1/engine/input_processor.py
`_validate_prompt_len`, "The decoder prompt cannot be empty"), so such a usage counts
nothing and the stream is counted as one without usage. A usage with a real prompt and 0
completion tokens (vLLM's continuous_usage_stats on its first chunk) is a count.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from proxy.core.apis import api_for
from proxy.core.apis.base import placeholder
from proxy.core.measurement import ErrorType, Measurement, TokenSource
from proxy.core.observe import StreamObserver

ZERO = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
REAL = {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}


def ollama_chunk(text: str | None, finish: str | None = None, usage: Any = ZERO) -> bytes:
    """One /v1/completions chunk as Ollama writes it (openai/openai.go CompletionChunk,
    ToCompleteChunk); `text` None: the usage chunk, its choices emptied."""
    choices = [] if text is None else [{"text": text, "index": 0, "finish_reason": finish}]
    chunk = {
        "id": "cmpl-42",
        "object": "text_completion",
        "created": 1755856800,
        "choices": choices,
        "model": "qwen3",
        "system_fingerprint": "fp_ollama",
        "usage": usage,
    }
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def replay(endpoint: str, body: dict[str, Any], reads: list[bytes]) -> Measurement:
    """`reads` fed 0.3 s apart after the head at 0.1 s, then the body's end."""
    api = api_for(endpoint)
    assert api is not None
    observer = StreamObserver(api.read_request(body), 0.0)
    observer.open(200, "text/event-stream", 0.1)
    now = 0.1
    for read in reads:
        now += 0.3
        observer.feed(read, now)
    observer.end_of_stream(now)
    return asyncio.run(
        observer.finish(
            end=now, started_at=0.0, status_code=200, error_type=None, error_message=None
        )
    )


ASKED = {
    "model": "qwen3",
    "prompt": "hi",
    "stream": True,
    "stream_options": {"include_usage": True},
}


def test_a_stream_cut_before_the_real_usage_is_counted_from_its_chunks() -> None:
    m = replay("/v1/completions", ASKED, [ollama_chunk("Hello"), ollama_chunk(" world")])
    assert m.error_type is ErrorType.STREAM_TRUNCATED
    assert (m.prompt_tokens, m.output_tokens, m.token_source) == (None, 2, TokenSource.CHUNKS)
    assert m.output_tokens_per_chunk() is None  # was 0.0: 0 tokens over 2 chunks


def test_the_real_usage_after_the_placeholders_is_the_count() -> None:
    m = replay("/v1/completions", ASKED, [
        ollama_chunk("Hello"), ollama_chunk(" world"),
        ollama_chunk("", "stop") + ollama_chunk(None, usage=REAL) + b"data: [DONE]\n\n",
    ])  # fmt: skip
    assert m.ok and m.finish_reason == "stop"
    assert (m.prompt_tokens, m.output_tokens, m.token_source) == (12, 3, TokenSource.USAGE)


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_the_rule_is_where_every_openai_shaped_usage_is_read(endpoint: str) -> None:
    api = api_for(endpoint)
    assert api is not None
    assert api.counts(ZERO) is None
    assert api.prompt_counts({**ZERO, "prompt_tokens_details": {"cached_tokens": 0}}) == (
        None,
        None,
        None,
    )
    # vLLM's continuous_usage_stats: the role chunk's usage has the prompt and 0 output
    first = {"prompt_tokens": 7, "total_tokens": 7, "completion_tokens": 0}
    counts = api.counts(first)
    assert counts is not None and (counts.prompt, counts.output) == (7, 0)
    assert api.prompt_counts(first) == (7, None, None)


@pytest.mark.parametrize(
    ("usage", "is_one"),
    [
        (ZERO, True),
        ({"prompt_tokens": 0, "completion_tokens": 0}, True),
        ({"prompt_tokens": 0, "completion_tokens": 1}, False),
        ({"prompt_tokens": 5, "completion_tokens": 0}, False),
        ({"prompt_tokens": False, "completion_tokens": False}, False),  # not counts at all
        ({"prompt_tokens": 0}, False),  # pooling's, no completion: not this rule's
        ({"input_tokens": 0, "output_tokens": 0}, False),  # Messages': its own reader
    ],
)
def test_placeholder(usage: dict[str, Any], is_one: bool) -> None:
    assert placeholder(usage) is is_one


def test_a_vllm_stream_with_continuous_usage_cut_early_keeps_its_usage() -> None:
    """vLLM 0.32's chunks with continuous_usage_stats (chat_completion/serving.py: every
    chunk's usage is the prompt and the tokens so far): cut after the first token, the
    usage it had is the count, as before."""

    def chunk(delta: dict[str, Any], completion: int) -> bytes:
        usage = {
            "prompt_tokens": 7,
            "total_tokens": 7 + completion,
            "completion_tokens": completion,
        }
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        obj = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
               "model": "m", "choices": [choice], "usage": usage}  # fmt: skip
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    body = {"model": "m", "messages": [], "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    m = replay("/v1/chat/completions", body, [
        chunk({"role": "assistant", "content": ""}, 0), chunk({"content": "Hi"}, 1)])  # fmt: skip
    assert m.error_type is ErrorType.STREAM_TRUNCATED
    assert (m.prompt_tokens, m.output_tokens, m.token_source) == (7, 1, TokenSource.USAGE)
