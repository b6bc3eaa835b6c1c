"""A whole answer larger than the observer keeps (MAX_KEPT_BODY): measured from its ends.

Real vLLM 0.32 answers (tests/fixtures/streams/vllm-0.32/), their longest text made long
enough to pass the bound, are read as the proxy reads them, in 64 KiB network reads: the
record says what the same answer's record says whole, as far as the ends hold it (usage,
finish, identity, the engine's figures); nothing of the middle is claimed; and a body the
proxy only kept the ends of is never a malformed one.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.core.apis import api_of
from proxy.core.json_ends import HEAD_BYTES
from proxy.core.measurement import ErrorType, Measurement, TokenSource
from proxy.core.observe import MAX_KEPT_BODY, Counter, StreamObserver
from proxy.core.request import CHAT, RequestInfo
from tests.paths import FIXTURES
from tests.tokenizers_local import loaded_counter

REAL = FIXTURES / "streams" / "vllm-0.32"
READ = 64 * 1024
#: Past any bound the observer has kept whole (8 MiB once, where such an answer was read
#: as malformed and measured not at all).
LONG = 9 * 1024 * 1024


def observed(
    body: bytes, endpoint: str, status: int = 200, collect: bool = False
) -> StreamObserver:
    info = RequestInfo(endpoint, "tiny", False, False, 40, 0.0)
    observer = StreamObserver(info, start=1.0, collect_text=collect)
    observer.open(status, "application/json", 1.5)
    for at in range(0, len(body), READ):
        observer.feed(body[at : at + READ], 2.0)
    observer.end_of_stream(2.0)
    return observer


def record(observer: StreamObserver, counter: Counter | None = None) -> Measurement:
    return asyncio.run(
        observer.finish(
            end=3.0,
            started_at=1e9,
            status_code=observer.status,
            error_type=None,
            error_message=None,
            counter=counter,
        )
    )


def lengthened(obj: Any, path: tuple[Any, ...], size: int) -> Any:
    """`obj` with the text at `path` made `size` characters long."""
    holder = obj
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = "x" * size
    return obj


CONTENT = ("choices", 0, "message", "content")
THINKING = ("content", 0, "thinking")


#: What the ends of an answer hold, field by field of the record.
FROM_THE_ENDS = (
    "status_code",
    "prompt_tokens",
    "output_tokens",
    "cached_prompt_tokens",
    "token_source",
    "finish_reason",
    "raw_finish_reason",
    "response_id",
    "response_model",
    "system_fingerprint",
    "engine",
    "error_type",
    "malformed_events",
)


@pytest.mark.parametrize(
    ("name", "endpoint", "text"),
    [
        ("chat_nonstream_metrics.json", CHAT, CONTENT),
        ("spec_completions_nonstream.json", "/v1/completions", ("choices", 0, "text")),
        ("invocations_completions_nonstream.json", "/v1/completions", ("choices", 0, "text")),
        # two choices, the first long: the last one's finish is read whole from the tail
        ("batch_chat_nonstream.json", "/v1/chat/completions/batch", CONTENT),
        ("reasoning_only_messages_nonstream.json", "/v1/messages", THINKING),
        (
            "reasoning_only_responses_nonstream.json",
            "/v1/responses",
            ("output", 0, "content", 0, "text"),
        ),
    ],
)
def test_a_long_answer_is_measured_from_its_ends_as_it_is_whole(
    name: str, endpoint: str, text: tuple[Any, ...]
) -> None:
    assert api_of(endpoint).endpoint == endpoint
    real = (REAL / name).read_bytes()
    long = orjson.dumps(lengthened(orjson.loads(real), text, LONG))
    whole, ends = record(observed(real, endpoint)), record(observed(long, endpoint))
    assert {f: getattr(ends, f) for f in FROM_THE_ENDS} == {
        f: getattr(whole, f) for f in FROM_THE_ENDS
    }
    assert ends.token_source is TokenSource.USAGE and ends.malformed_events == 0


def test_only_the_head_of_a_long_answer_is_kept() -> None:
    real = orjson.loads((REAL / "chat_nonstream_metrics.json").read_bytes())
    long = orjson.dumps(lengthened(real, CONTENT, 20 * 1024 * 1024))
    observer = observed(long, CHAT)
    assert observer.body() == long[:HEAD_BYTES]


def test_the_middle_of_a_long_answer_is_not_claimed() -> None:
    """A body of reasoning alone is known as one only whole (every output token then goes
    to the reasoning: test_observe.py); from its ends, nothing is said of its reasoning."""
    real = orjson.loads((REAL / "reasoning_only_messages_nonstream.json").read_bytes())
    long = orjson.dumps(lengthened(real, THINKING, 2 * MAX_KEPT_BODY))
    m = record(observed(long, "/v1/messages"))
    assert (m.output_tokens, m.reasoning_tokens, m.without_answer) == (40, None, None)


def test_an_answer_just_at_the_bound_is_read_whole() -> None:
    real = orjson.loads((REAL / "reasoning_only_messages_nonstream.json").read_bytes())
    empty = len(orjson.dumps(lengthened(real, THINKING, 0)))
    body = orjson.dumps(lengthened(real, THINKING, MAX_KEPT_BODY - empty))
    assert len(body) == MAX_KEPT_BODY
    m = record(observed(body, "/v1/messages"))
    assert (m.reasoning_tokens, m.reasoning_token_source) == (40, "output")  # read whole


def test_a_long_body_whose_ends_say_nothing_is_no_malformed_event() -> None:
    """The proxy cut it, not the backend: the exchange counts it as a measuring limit
    (tokenprobe_measurement_failures_total{stage="body_too_large"})."""
    observer = observed(b"<html>" + b"x" * (2 * MAX_KEPT_BODY) + b"</html>", CHAT)
    m = record(observer)
    assert (m.error_type, m.malformed_events, m.output_tokens) == (None, 0, None)
    assert observer.unread_body
    small = observed(b"<html>x</html>", CHAT)
    assert record(small).malformed_events == 1 and not small.unread_body


def test_a_long_error_body_is_read_from_its_head() -> None:
    body = orjson.dumps(
        {"error": {"message": "maximum context length is 4096 tokens", "code": 400}}
    )
    long = body[:-2] + b', "detail": "' + b"y" * (2 * MAX_KEPT_BODY) + b'"}}'
    error, message = observed(long, CHAT, status=400).outcome()
    assert error is ErrorType.CONTEXT_LENGTH  # its words, as the head holds them
    assert message is not None and message.startswith('{"error":')


def test_a_long_answer_without_usage_is_not_counted_from_texts_it_did_not_keep(
    tmp_path: Path,
) -> None:
    """A tokenizer counts a whole answer's texts; of one read from its ends it has none,
    and an output of 0 would be a count of nothing: no count."""
    counter = loaded_counter(tmp_path)
    real = orjson.loads((REAL / "chat_nonstream_metrics.json").read_bytes())
    del real["usage"]
    real["choices"][0]["message"]["content"] = "The quick brown fox"
    short = record(observed(orjson.dumps(real), CHAT, collect=True), counter)
    long = orjson.dumps(lengthened(real, CONTENT, 2 * MAX_KEPT_BODY))
    ends = record(observed(long, CHAT, collect=True), counter)
    counter.close()
    assert short.token_source is TokenSource.TOKENIZER and short.output_tokens
    assert (ends.token_source, ends.output_tokens) == (TokenSource.NONE, None)
