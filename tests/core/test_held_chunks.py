"""What a chat or completions stream's chunks count when no usage comes, on real vLLM 0.32
streams (tests/fixtures/streams/vllm-0.32-held/README.md gives each request and vLLM's own
count), fed one event a read at synthetic times.

vLLM sends a chunk for every engine output of a choice, an empty delta where it holds the
text back (chat_completion/serving.py and completion/serving.py: the delta's text is
`output.text`); the role chunk and chat's `echo` of the prompt's last message are no
output. An empty delta is no first token.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import orjson

from proxy.core.apis import api_for
from proxy.core.measurement import Measurement, TokenSource
from proxy.core.observe import Counter, StreamObserver
from proxy.core.tokens import TokenCounter
from tests.paths import FIXTURES
from tests.tokenizers_local import build_tiny_tokenizer

HELD = FIXTURES / "streams" / "vllm-0.32-held"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
QUESTION = {"role": "user", "content": "what is the weather?"}
ECHOED = "The weather today is sunny and warm with a light breeze"
N2 = {"model": "tiny", "messages": [QUESTION], "max_tokens": 12, "n": 2, "stream": True}
BATCH = {"model": "tiny", "prompt": ["The weather is", "hello there"], "max_tokens": 12,
         "stream": True}  # fmt: skip
ECHO = {
    "model": "tiny",
    "messages": [QUESTION, {"role": "assistant", "content": ECHOED}],
    "max_tokens": 6,
    "n": 2,
    "stream": True,
    "echo": True,
    "add_generation_prompt": False,
    "continue_final_message": True,
}


def reads(name: str) -> list[bytes]:
    raw = (HELD / name).read_bytes()
    return [part + b"\n\n" for part in raw.split(b"\n\n") if part]


def generated(read: bytes) -> bool:
    """The read carries generated text: not the role chunk, nor an empty delta or echo."""
    if not read.startswith(b"data: {"):
        return False
    (choice,) = orjson.loads(read[6:])["choices"]
    delta = choice.get("delta")
    if delta is None:
        return bool(choice["text"])
    text = delta.get("content") or delta.get("reasoning") or delta.get("tool_calls")
    return bool(text) and "role" not in delta and text != ECHOED


def record(
    endpoint: str, body: dict[str, Any], events: list[bytes], counter: Counter | None = None
) -> tuple[StreamObserver, Measurement]:
    """The record of `events`, the i-th read at i/8 s."""
    api = api_for(endpoint)
    assert api is not None
    observer = StreamObserver(api.read_request(body), 0.0, collect_text=counter is not None)
    observer.open(200, "text/event-stream; charset=utf-8", 0.0)
    for i, event in enumerate(events, 1):
        observer.feed(event, i / 8)
    observer.end_of_stream(4.0)
    finished = observer.finish(
        end=4.0, started_at=0.0, status_code=200, error_type=None, error_message=None,
        counter=counter,
    )  # fmt: skip
    return observer, asyncio.run(finished)


def first_generated(events: list[bytes]) -> float:
    return next(i for i, event in enumerate(events, 1) if generated(event)) / 8


def test_chat_chunks_with_held_back_text_count_every_token() -> None:
    events = reads("chat_n2_no_usage.sse")
    _, m = record(CHAT, N2, events)
    assert (m.output_tokens, m.token_source) == (24, TokenSource.CHUNKS)  # vLLM generated 24
    assert m.content_events == sum(map(generated, events)) < 24
    assert m.ttft == first_generated(events)


def test_completion_chunks_with_held_back_text_count_every_token() -> None:
    events = reads("completions_two_prompts_no_usage.sse")
    _, m = record(COMPLETIONS, BATCH, events)
    assert (m.output_tokens, m.token_source) == (24, TokenSource.CHUNKS)
    assert m.content_events == sum(map(generated, events)) < 24
    assert m.ttft == first_generated(events)


def test_an_empty_delta_is_no_first_token() -> None:
    events = reads("chat_n2_no_usage.sse")
    empty = next(i for i, e in enumerate(events) if b'"delta":{"reasoning":""}' in e)
    # the role chunks, then the empty delta alone: no token yet
    _, m = record(CHAT, N2, [*events[:2], events[empty]])
    assert m.ttft is None and m.content_events == 0
    assert (m.output_tokens, m.token_source) == (1, TokenSource.CHUNKS)  # one engine output


def test_chat_echo_is_no_output_and_no_first_token() -> None:
    events = reads("chat_echo_n2_no_usage.sse")
    assert sum(ECHOED.encode() in e for e in events) == 2  # one a choice
    _, m = record(CHAT, ECHO, events)
    assert (m.output_tokens, m.token_source) == (12, TokenSource.CHUNKS)  # vLLM generated 12
    assert m.content_events == sum(map(generated, events))
    assert m.ttft == first_generated(events) > 4 / 8  # after both role and both echo reads


def loaded_counter(directory: Path) -> TokenCounter:
    counter = TokenCounter(str(build_tiny_tokenizer(directory)))
    deadline = time.monotonic() + 30
    while not counter.ready and time.monotonic() < deadline:
        time.sleep(0.05)
    return counter


def test_a_tokenizer_leaves_chat_echo_out(tmp_path: Path) -> None:
    counter = loaded_counter(tmp_path)
    events = reads("chat_echo_n2_no_usage.sse")
    _, echoed = record(CHAT, ECHO, events, counter)
    without = [e for e in events if ECHOED.encode() not in e]
    _, alone = record(CHAT, {**ECHO, "echo": False}, without, counter)
    counter.close()
    assert echoed.token_source is TokenSource.TOKENIZER
    assert echoed.output_tokens == alone.output_tokens
