"""A whole answer too large for the proxy to keep is relayed whole and measured from its
ends, on both data paths (proxy/core/json_ends.py).

A batch of embeddings passes 8 MiB easily (vLLM's EmbeddingResponse ends with its `usage`:
vllm/entrypoints/pooling/embed/protocol.py), and a chat answer with logprobs soon after
it. The backend is raw bytes, so the answer is exact; the client reads it all and checks
it byte for byte, and the record and the scraped figures say what the answer's ends say.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator

import httpx
import orjson
import pytest

from tests.conftest import ProxyUnderTest
from tests.edge_backend import RawBackend

MODEL = "m"
MiB = 1024 * 1024
CHAT, EMBEDDINGS = "/v1/chat/completions", "/v1/embeddings"


def answer(body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: "
        + content_type
        + b"\r\ncontent-length: %d\r\n\r\n" % len(body)
        + body
    )


def long_chat() -> bytes:
    """vLLM 0.32's ChatCompletionResponse, its fields in its order, 9 MiB of text in it."""
    return orjson.dumps(
        {
            "id": "chatcmpl-long",
            "object": "chat.completion",
            "created": 1796137526,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "a " * (9 * MiB // 2)},
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                    "token_ids": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": "vllm-0.32.0-30e38e1f",
            "usage": {"prompt_tokens": 7, "total_tokens": 2359303, "completion_tokens": 2359296},
            "prompt_logprobs": None,
            "prompt_token_ids": None,
        }
    )


def embedded() -> bytes:
    """A batch of 700 vectors of 1024 dimensions, as vLLM writes its EmbeddingResponse."""
    return orjson.dumps(
        {
            "id": "embd-long",
            "object": "list",
            "created": 1796137526,
            "model": MODEL,
            "data": [
                {"index": i, "object": "embedding", "embedding": [-0.0123456789] * 1024}
                for i in range(700)
            ],
            "usage": {"prompt_tokens": 6400, "total_tokens": 6400, "completion_tokens": 0},
        }
    )


STARTED: list[RawBackend] = []


@pytest.fixture(autouse=True)
def _stop_backends() -> Iterator[None]:
    yield
    while STARTED:
        STARTED.pop().stop()


def proxied(start_proxy: Callable[..., ProxyUnderTest], response: bytes) -> ProxyUnderTest:
    STARTED.append(RawBackend(response=response).start())
    return start_proxy(STARTED[-1].url, model_allowlist=(MODEL,))


def relayed(proxy: ProxyUnderTest, path: str, body: bytes) -> None:
    """The answer, asked for not streamed, comes to the client whole."""
    ask = (
        {"model": MODEL, "input": ["hi"]}
        if path == EMBEDDINGS
        else {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
        }
    )
    got = httpx.post(proxy.url + path, json=ask, timeout=60)
    assert got.status_code == 200
    assert hashlib.sha256(got.content).digest() == hashlib.sha256(body).digest()


def counted(proxy: ProxyUnderTest, path: str, finish: str) -> dict[str, float]:
    labels = {"model": MODEL, "endpoint": path}
    return {
        "ok": proxy.sample(
            "tokenprobe_requests_total",
            **labels,
            code="200",
            error_type="none",
            finish_reason=finish,
        ),
        "malformed": proxy.sample("tokenprobe_malformed_events_total", **labels),
        "unread": proxy.sample("tokenprobe_measurement_failures_total", stage="body_too_large"),
    }


def test_a_long_chat_answer_is_measured_from_its_ends(
    start_proxy: Callable[..., ProxyUnderTest],
) -> None:
    body = long_chat()
    assert len(body) > 9 * MiB
    proxy = proxied(start_proxy, answer(body))
    relayed(proxy, CHAT, body)
    (m,) = proxy.wait_records(1, exact=True)
    assert (m.error_type, m.finish_reason, m.malformed_events) == (None, "length", 0)
    assert (m.prompt_tokens, m.output_tokens, m.token_source.value) == (7, 2359296, "usage")
    assert (m.response_id, m.response_model) == ("chatcmpl-long", MODEL)
    assert m.system_fingerprint == "vllm-0.32.0-30e38e1f"
    assert counted(proxy, CHAT, "length") == {"ok": 1, "malformed": 0, "unread": 0}


def test_a_batch_of_embeddings_is_counted_from_its_usage(
    start_proxy: Callable[..., ProxyUnderTest],
) -> None:
    body = embedded()
    assert len(body) > 9 * MiB
    proxy = proxied(start_proxy, answer(body))
    relayed(proxy, EMBEDDINGS, body)
    (m,) = proxy.wait_records(1, exact=True)
    assert (m.error_type, m.prompt_tokens, m.token_source.value) == (None, 6400, "usage")
    assert (m.response_id, m.malformed_events) == ("embd-long", 0)
    assert counted(proxy, EMBEDDINGS, "none") == {"ok": 1, "malformed": 0, "unread": 0}


def test_a_long_answer_whose_ends_say_nothing_is_a_limit_not_a_malformed_body(
    start_proxy: Callable[..., ProxyUnderTest],
) -> None:
    """A gateway's 200 page where the answer should be: the proxy cut it to its ends, so
    it is no malformed answer; the stage counts what the proxy could not read."""
    page = b"<html>" + b"<p>busy</p>" * MiB + b"</html>"
    proxy = proxied(start_proxy, answer(page, b"text/html"))
    relayed(proxy, CHAT, page)
    (m,) = proxy.wait_records(1, exact=True)
    assert (m.error_type, m.malformed_events, m.output_tokens) == (None, 0, None)
    assert counted(proxy, CHAT, "none") == {"ok": 1, "malformed": 0, "unread": 1}
