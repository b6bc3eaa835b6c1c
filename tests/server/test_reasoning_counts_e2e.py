"""Reasoning counts through the proxy, on both relays, from a raw upstream that answers
with vLLM 0.32's bytes carrying a read-only review's figures (R7, a real vLLM and its token
ids; tests/core/test_reasoning_counts_vllm.py builds the bytes and says what each holds):

- a stream whose 27 reasoning tokens came as 15 reasoning deltas and 12 empty ones
  (`"reasoning": ""`, the token's bytes held back), then the answer: 27, not 15;
- a body of reasoning alone whose usage counts only after a late `<think>` (4 of 40): all
  40 output tokens were reasoning;
- a body of one token (the EOS), finish `tool_calls`, no call, no content: an answer
  without answer (`stop`), as its stream is.

The client gets the upstream's bytes unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from proxy.core.measurement import Measurement
from tests.conftest import MODEL, ProxyUnderTest
from tests.core.test_reasoning_counts_vllm import LATE_THINK, body, r7_stream
from tests.hostile.peers import Conn, Request, by_target, raw_upstream

CHAT = "/v1/chat/completions"
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
#: The review's requests, told apart by their seeds (s4t4, p-none2, repro_empty).
STREAMED, LATE, EMPTY = 144, 34, 1
ANSWERS = {
    LATE: body(LATE_THINK, "length", 40, 4),
    EMPTY: body({"content": None, "tool_calls": []}, "tool_calls", 1, 0),
}


def json_answer(payload: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    return head % len(payload) + payload


async def vllm_like(conn: Conn, request: Request) -> None:
    """The answer the request's seed names: the stream one event a write, or a body."""
    seed = orjson.loads(request.body)["seed"]
    if seed != STREAMED:
        conn.write(json_answer(ANSWERS[seed]))
        await conn.drain()
        return
    conn.write(SSE_HEAD)
    for event in r7_stream():
        conn.write(b"%x\r\n%b\r\n" % (len(event), event))
        await conn.drain()
    conn.write(b"0\r\n\r\n")
    await conn.drain()


@pytest.fixture
def proxy(start_proxy: Callable[..., ProxyUnderTest]) -> Iterator[ProxyUnderTest]:
    with raw_upstream() as upstream:
        upstream.default = by_target({CHAT.encode(): vllm_like})
        yield start_proxy(upstream.url)


def sent(proxy: ProxyUnderTest, seed: int, **more: Any) -> tuple[Measurement, bytes]:
    """The record of one request and the bytes its client got."""
    n = len(proxy.records)
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}],
               "max_tokens": 40, "seed": seed, **more}  # fmt: skip
    received = httpx.post(proxy.url + CHAT, json=request, timeout=30)
    assert received.status_code == 200
    return proxy.wait_records(n + 1, timeout=30)[-1], received.content


def count(proxy: ProxyUnderTest, name: str, **labels: str) -> float:
    return proxy.sample(name, model=MODEL, endpoint=CHAT, **labels)


def test_a_stream_s_empty_reasoning_deltas_are_reasoning_tokens(proxy: ProxyUnderTest) -> None:
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    m, received = sent(proxy, STREAMED, **usage)
    assert received == b"".join(r7_stream())  # as the upstream wrote it
    assert (m.output_tokens, m.reasoning_events, m.without_answer) == (40, 15, None)
    assert (m.reasoning_tokens, m.reasoning_token_source) == (27, "events")  # was 15
    assert count(proxy, "tokenprobe_reasoning_tokens_total", source="events") == 27


def test_whole_answers_without_an_answer_are_counted_as_such(proxy: ProxyUnderTest) -> None:
    late, received = sent(proxy, LATE)
    assert received == ANSWERS[LATE]
    assert (late.output_tokens, late.reasoning_tokens) == (40, 40)  # was 4, usage
    assert (late.reasoning_token_source, late.without_answer) == ("output", "length")
    empty, received = sent(proxy, EMPTY)
    assert received == ANSWERS[EMPTY]
    assert (empty.output_tokens, empty.finish_reason) == (1, "tool_calls")
    assert empty.without_answer == "stop"  # was None
    assert count(proxy, "tokenprobe_requests_without_answer_total", reason="stop") == 1
    assert count(proxy, "tokenprobe_requests_without_answer_total", reason="length") == 1
