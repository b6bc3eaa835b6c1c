"""Output tokens counted from a chat or completions stream's chunks, where no usage comes
(n > 1 and a batch of prompts: the proxy does not ask, proxy/core/apis/chat.py
ask_for_usage), and chat's `echo`, end to end through the simulator.

vLLM sends a chunk for every engine output of a choice, with an empty delta while it
holds the text back (a stop string's possible start, incomplete UTF-8) and for the EOS
with the finish; chat's `echo` gives the prompt's last message back as content before any
token. The simulator does both (proxy/sim/stops.py HeldText, proxy/sim/stream.py
echoed_message); the backend's own count is its usage, asked for directly.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from proxy.core.measurement import TokenSource
from tests.conftest import MODEL, ProxyUnderTest, Running

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES: Any = [{"role": "user", "content": "Hello there"}]
#: Never met, so every step holds back its text's last characters (a possible start).
STOP = ["zzzzzzzzzzzzzzzzzzzzzzzz"]
ECHOED = "The answer so far"
ECHO: Any = [*MESSAGES, {"role": "assistant", "content": ECHOED}]
#: vLLM renders a list of parts as their non-empty texts joined with "\n"
#: (renderers/chat_utils.py, _parse_chat_message_content_parts), and echoes that.
PARTS: Any = [{"type": "text", "text": "The answer"}, {"type": "text", "text": ""}, "so far"]
PARTS_ECHOED = "The answer\nso far"
#: The keys of vLLM 0.32's echo choice, in order (no `token_ids`, which content chunks have):
#: tests/fixtures/streams/vllm-0.32-held/chat_echo_n2_no_usage.sse
ECHO_CHOICE = ["index", "delta", "logprobs", "finish_reason"]


def events(
    url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """The stream's `data:` objects, as the client got them."""
    with httpx.stream("POST", url + path, json=body, headers=headers or {}, timeout=30) as r:
        assert r.status_code == 200
        raw = b"".join(r.iter_bytes())
    lines = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: {")]
    return [orjson.loads(line) for line in lines]


def backend_count(sim: Running, path: str, body: dict[str, Any]) -> int:
    """The backend's own count of the output: its usage, asked for directly."""
    asked = {**body, "stream_options": {"include_usage": True}}
    (usage,) = [e["usage"] for e in events(sim.url, path, asked) if e.get("usage")]
    count = usage["completion_tokens"]
    assert isinstance(count, int)
    return count


def with_content(stream: list[dict[str, Any]]) -> int:
    """The events that carry generated text (a chat delta's content, a completion's text)."""
    found = 0
    for event in stream:
        for choice in event.get("choices") or ():
            delta = choice.get("delta")
            if (delta.get("content") if delta is not None else choice.get("text")) and (
                delta is None or "role" not in delta
            ):
                found += 1
    return found


def test_held_back_chunks_count_as_output_in_chat_with_two_choices(
    sim: Running, proxy: ProxyUnderTest
) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "n": 2, "stop": STOP, "stream": True}
    truth = backend_count(sim, CHAT, body)
    stream = events(proxy.url, CHAT, body)
    (m,) = proxy.wait_records(1, exact=True)
    assert m.ok and m.token_source is TokenSource.CHUNKS
    assert with_content(stream) < truth  # held-back text and the EOS: chunks without text
    assert m.output_tokens == truth
    assert m.content_events == with_content(stream)  # an empty delta is no content


def test_held_back_chunks_count_as_output_in_a_batch_of_prompts(
    sim: Running, proxy: ProxyUnderTest
) -> None:
    body = {"model": MODEL, "prompt": ["Hello", "there"], "stop": STOP, "stream": True}
    truth = backend_count(sim, COMPLETIONS, body)
    stream = events(proxy.url, COMPLETIONS, body)
    (m,) = proxy.wait_records(1, exact=True)
    assert m.ok and m.token_source is TokenSource.CHUNKS
    assert with_content(stream) < truth
    assert m.output_tokens == truth
    assert m.content_events == with_content(stream)


def test_chat_echo_is_no_output(sim: Running, proxy: ProxyUnderTest) -> None:
    body = {"model": MODEL, "messages": ECHO, "n": 2, "stream": True, "echo": True}
    truth = backend_count(sim, CHAT, body)
    stream = events(proxy.url, CHAT, body)
    echoes = [e for e in stream if e["choices"][0].get("delta", {}).get("content") == ECHOED]
    assert len(echoes) == 2  # one a choice, as vLLM sends them, and in its shape
    assert [list(e["choices"][0]) for e in echoes] == [ECHO_CHOICE] * 2
    (m,) = proxy.wait_records(1, exact=True)
    assert m.ok and m.token_source is TokenSource.CHUNKS
    assert m.content_events == with_content(stream) - 2
    assert m.output_tokens == truth


def test_chat_echo_is_no_first_token(sim: Running, proxy: ProxyUnderTest) -> None:
    # The role chunks (and so the echo after them) sent with the headers, long before the
    # first token (x-sim-early-role): the echo's read is then no TTFT.
    body = {"model": MODEL, "messages": ECHO, "n": 2, "stream": True, "echo": True}
    events(proxy.url, CHAT, body, {"x-sim-early-role": "1", "x-sim-ttft": "0.3"})
    (m,) = proxy.wait_records(1, exact=True)
    assert m.ok and m.ttft is not None
    assert m.ttft >= 0.3  # the first token is due 0.3 s in; load only makes it later


def test_chat_echo_of_a_list_of_parts_is_no_output(sim: Running, proxy: ProxyUnderTest) -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": PARTS}]
    body = {"model": MODEL, "messages": messages, "n": 2, "stream": True, "echo": True}
    truth = backend_count(sim, CHAT, body)
    stream = events(proxy.url, CHAT, body)
    echoes = [e for e in stream if e["choices"][0].get("delta", {}).get("content") == PARTS_ECHOED]
    assert len(echoes) == 2  # the simulator echoes the parts' text, as vLLM does
    (m,) = proxy.wait_records(1, exact=True)
    assert m.ok and m.token_source is TokenSource.CHUNKS
    assert m.content_events == with_content(stream) - 2
    assert m.output_tokens == truth


@pytest.mark.parametrize(
    ("content", "backend", "n"),
    [([{"type": "text", "text": ""}], "vllm", 2), (ECHOED, "llamacpp", 1)],
    ids=["vllm-empty-message", "llamacpp"],  # (llama-server refuses n > 1)
)
def test_no_echo_sent_keeps_every_token(
    sim: Running, proxy: ProxyUnderTest, content: Any, backend: str, n: int
) -> None:
    """`echo` asked for, and none sent: vLLM for a message it renders empty, llama-server
    ever. The first tokens are output, and the first is the first token."""
    messages = [*MESSAGES, {"role": "assistant", "content": content}]
    body = {"model": MODEL, "messages": messages, "n": n, "stream": True, "echo": True,
            "max_tokens": 3}  # fmt: skip
    # the first token due 0.1 s in, every next one 0.5 s later
    headers = {"x-sim-backend-kind": backend, "x-sim-ttft": "0.1", "x-sim-tps": "2"}
    stream = events(proxy.url, CHAT, body, headers)
    assert not any(ECHOED in str(e) for e in stream)  # no echo came
    (m,) = proxy.wait_records(1, exact=True)
    assert m.ok and m.content_events == with_content(stream) == 3 * n
    assert m.ttft is not None and m.ttft < 0.5  # not the second token's 0.6 s
