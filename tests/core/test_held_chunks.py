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
from pathlib import Path
from typing import Any

import orjson

from proxy.core.apis import api_for
from proxy.core.measurement import Measurement, TokenSource
from proxy.core.observe import Counter, StreamObserver
from tests.paths import FIXTURES
from tests.tokenizers_local import loaded_counter

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


def test_a_tokenizer_leaves_chat_echo_out(tmp_path: Path) -> None:
    counter = loaded_counter(tmp_path)
    events = reads("chat_echo_n2_no_usage.sse")
    _, echoed = record(CHAT, ECHO, events, counter)
    without = [e for e in events if ECHOED.encode() not in e]
    _, alone = record(CHAT, {**ECHO, "echo": False}, without, counter)
    counter.close()
    assert echoed.token_source is TokenSource.TOKENIZER
    assert echoed.output_tokens == alone.output_tokens


def chat_chunk(choice: dict[str, Any]) -> bytes:
    """A chat chunk of one choice, `data:` framed."""
    obj = {"id": "x", "object": "chat.completion.chunk", "model": "m", "choices": [choice]}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


ROLE = chat_chunk({"index": 0, "delta": {"role": "assistant", "content": ""}})
WORDS = [chat_chunk({"index": 0, "delta": {"content": f" w{i}"}}) for i in range(5)]
ONE = {"model": "m", "messages": [QUESTION], "stream": True}


def test_openai_finish_in_a_chunk_of_its_own_is_no_token() -> None:
    """OpenAI and llama-server end a choice with `delta: {}` and the finish, no
    `stop_reason`: the finish of the last token's step, not an engine output of its own
    (the 5 words at 2/8..6/8 s: TPOT 1/8 s)."""
    for why in ("stop", "length"):
        finish = chat_chunk({"index": 0, "delta": {}, "finish_reason": why})
        _, m = record(CHAT, ONE, [ROLE, *WORDS, finish, b"data: [DONE]\n\n"])
        assert (m.output_tokens, m.token_source) == (5, TokenSource.CHUNKS), why
        assert m.tpot == 1 / 8, why


def test_keep_alive_empty_deltas_are_no_tokens() -> None:
    keep_alive = chat_chunk({"index": 0, "delta": {}, "logprobs": None, "finish_reason": None})
    stream = [ROLE, *(e for word in WORDS for e in (word, keep_alive)), b"data: [DONE]\n\n"]
    _, m = record(CHAT, ONE, stream)
    assert m.output_tokens == 5
    assert m.tpot == 2 / 8  # the words, a read apart each


def test_vllm_finish_without_text_is_the_eos_token() -> None:
    """vLLM's EOS: `{}` (a parser gave no delta) or `{"content": ""}`, with the finish
    and `stop_reason` (chat_completion/serving.py); a token of its own, whose read ends
    TPOT's span: 6 tokens at 2/8..7/8 s."""
    for delta in ({}, {"content": ""}):
        eos = chat_chunk({"index": 0, "delta": delta, "logprobs": None,
                          "finish_reason": "stop", "stop_reason": None, "token_ids": None})  # fmt: skip
        _, m = record(CHAT, ONE, [ROLE, *WORDS, eos, b"data: [DONE]\n\n"])
        assert m.output_tokens == 6, delta
        assert m.tpot == 1 / 8, delta


def test_vllm_empty_delta_with_logprobs_is_a_token() -> None:
    """vLLM sends `{}` without a finish only for a step whose parser gave no delta, when
    logprobs or token ids were asked for (chat_completion/serving.py, `if delta_message
    is None`): a token."""
    control = chat_chunk({"index": 0, "delta": {}, "logprobs": {"content": []},
                          "finish_reason": None, "token_ids": None})  # fmt: skip
    _, m = record(CHAT, ONE, [ROLE, control, *WORDS, b"data: [DONE]\n\n"])
    assert m.output_tokens == 6


def test_completions_finish_in_a_chunk_of_its_own_is_no_token() -> None:
    def chunk(text: str, why: str | None = None) -> bytes:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": why}
        obj = {"id": "x", "object": "text_completion", "model": "m", "choices": [choice]}
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    stream = [*(chunk(f" w{i}") for i in range(5)), chunk("", "length"), b"data: [DONE]\n\n"]
    _, m = record(COMPLETIONS, {"model": "m", "prompt": "hi", "stream": True}, stream)
    assert (m.output_tokens, m.tpot) == (5, 1 / 8)


def echo_request(content: Any) -> dict[str, Any]:
    messages = [QUESTION, {"role": "assistant", "content": content}]
    return {"model": "m", "messages": messages, "stream": True, "echo": True}


def test_chat_echo_of_a_list_of_parts_is_its_texts_joined() -> None:
    """vLLM renders a list of parts as their non-empty texts joined with "\\n"
    (renderers/chat_utils.py, _parse_chat_message_content_parts) and echoes that."""
    parts = [{"type": "text", "text": "The answer"}, {"type": "text", "text": ""}, "so far"]
    echo = chat_chunk({"index": 0, "delta": {"content": "The answer\nso far"}})
    _, m = record(CHAT, echo_request(parts), [ROLE, echo, *WORDS, b"data: [DONE]\n\n"])
    assert (m.output_tokens, m.content_events) == (5, 5)
    assert m.ttft == 3 / 8


def test_a_first_token_that_is_not_the_echo_ends_the_wait() -> None:
    """llama-server sends no echo (its first content may even begin with the message it
    continues), and vLLM none for a message it renders empty: the first content event is
    the first token."""
    cases = [("Once upon", " w0"), ("Once upon", "Once upon w0"), ([{"type": "text", "text": ""}], " w0")]  # fmt: skip
    for content, first in cases:
        opening = chat_chunk({"index": 0, "delta": {"content": first}})
        _, m = record(CHAT, echo_request(content), [ROLE, opening, *WORDS[1:], b"data: [DONE]\n\n"])
        assert (m.output_tokens, m.content_events) == (5, 5), (content, first)
        assert m.ttft == 2 / 8, (content, first)
