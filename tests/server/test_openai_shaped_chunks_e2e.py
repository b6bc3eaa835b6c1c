"""Output tokens counted from the chunks of an OpenAI-shaped stream, end to end: a raw
upstream that streams as OpenAI's API and llama-server do, each token a chunk with text,
then the finish in a chunk of its own (chat `"delta": {}`, completions `"text": ""`), and,
as some gateways do, keep-alive `"delta": {}` chunks between tokens. Neither is a token:
vLLM sends a chunk without text for every engine output (its held-back text, its EOS),
which the chunks count (tests/server/test_held_chunks_e2e.py), but its finish carries
`stop_reason` and its empty deltas an empty text, which these have not.

No usage is asked for (n > 1, or --inject-usage off), so the count is the chunks'
(`source="chunks"`); TPOT is a choice's span over its tokens, the mean of its ITLs when
each token is a chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from proxy.core.measurement import Measurement, TokenSource
from tests.conftest import MODEL, ProxyUnderTest
from tests.hostile.peers import Conn, RawUpstream, Request, by_target, raw_upstream

TOKENS = 5  # a choice
GAP = 0.02  # between a choice's tokens
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def framed(obj: dict[str, Any] | None) -> bytes:
    event = b"data: [DONE]\n\n" if obj is None else b"data: " + orjson.dumps(obj) + b"\n\n"
    return b"%x\r\n%b\r\n" % (len(event), event)


def openai_like(chat: bool, finish: str, keep_alive: bool = False) -> Any:
    """A handler streaming `TOKENS` tokens to each of the request's `n` choices, then
    each choice's finish (`finish`) in a chunk of its own; `keep_alive`: a `delta: {}`
    after every token (chat)."""

    async def handle(conn: Conn, request: Request) -> None:
        n = orjson.loads(request.body).get("n") or 1
        head = {"id": "x", "object": "chat.completion.chunk" if chat else "text_completion",
                "created": 1, "model": MODEL}  # fmt: skip

        def chunk(index: int, piece: dict[str, Any], why: str | None = None) -> bytes:
            choice = {"index": index, **piece, "logprobs": None, "finish_reason": why}
            return framed({**head, "choices": [choice]})

        conn.write(SSE_HEAD)
        if chat:
            conn.write(b"".join(chunk(i, {"delta": {"role": "assistant", "content": ""}})
                                for i in range(n)))  # fmt: skip
        for t in range(TOKENS):
            await asyncio.sleep(GAP)
            for i in range(n):
                conn.write(
                    chunk(i, {"delta": {"content": f" w{t}"}} if chat else {"text": f" w{t}"})
                )
                if keep_alive:
                    conn.write(chunk(i, {"delta": {}}))
            await conn.drain()
        await asyncio.sleep(GAP)
        for i in range(n):
            conn.write(chunk(i, {"delta": {}} if chat else {"text": ""}, finish))
        conn.write(framed(None) + b"0\r\n\r\n")
        await conn.drain()

    return handle


@pytest.fixture
def upstream() -> Iterator[RawUpstream]:
    with raw_upstream() as server:
        yield server


def measured(
    upstream: RawUpstream,
    start_proxy: Callable[..., ProxyUnderTest],
    chat: bool,
    n: int,
    finish: str,
    keep_alive: bool = False,
) -> Measurement:
    path = b"/v1/chat/completions" if chat else b"/v1/completions"
    upstream.default = by_target({path: openai_like(chat, finish, keep_alive)})
    proxy = start_proxy(upstream.url, inject_usage=False)
    body: dict[str, Any] = {"model": MODEL, "stream": True, "n": n}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    with httpx.stream("POST", proxy.url + path.decode(), json=body, timeout=30) as r:
        assert r.status_code == 200
        r.read()
    (m,) = proxy.wait_records(1, exact=True)
    assert m.ok and m.token_source is TokenSource.CHUNKS
    return m


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_a_finish_in_a_chunk_of_its_own_is_no_token(
    upstream: RawUpstream, start_proxy: Callable[..., ProxyUnderTest], finish: str
) -> None:
    m = measured(upstream, start_proxy, chat=True, n=2, finish=finish)
    assert m.content_events == 2 * TOKENS
    assert m.output_tokens == 2 * TOKENS  # not one more a choice


def test_keep_alive_empty_deltas_are_no_tokens(
    upstream: RawUpstream, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    m = measured(upstream, start_proxy, chat=True, n=2, finish="stop", keep_alive=True)
    assert m.output_tokens == 2 * TOKENS


def test_a_completions_finish_with_empty_text_is_no_token(
    upstream: RawUpstream, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    m = measured(upstream, start_proxy, chat=False, n=2, finish="length")
    assert m.output_tokens == 2 * TOKENS


@pytest.mark.parametrize(
    ("finish", "keep_alive"),
    [("stop", False), ("length", False), ("stop", True)],
    ids=["stop", "length", "keep-alive"],
)
def test_tpot_spans_the_tokens_alone(
    upstream: RawUpstream,
    start_proxy: Callable[..., ProxyUnderTest],
    finish: str,
    keep_alive: bool,
) -> None:
    """One choice, each token a chunk: TPOT is exactly the mean ITL, whatever else came."""
    m = measured(upstream, start_proxy, chat=True, n=1, finish=finish, keep_alive=keep_alive)
    assert m.output_tokens == TOKENS
    itl = m.inter_token_latencies
    assert len(itl) == TOKENS - 1
    assert m.tpot == pytest.approx(sum(itl) / len(itl), rel=1e-9)
