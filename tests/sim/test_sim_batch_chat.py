"""vLLM 0.32's batch chat, `/v1/chat/completions/batch`, from the simulator: key for key
the real answer captured in tests/fixtures/streams/vllm-0.32/batch_chat_nonstream.json
(one chat completion, a choice per conversation, `usage` summing them, `"metrics": null`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from proxy.sim import SimApp, SimConfig
from tests.paths import STREAMS
from tests.servers import ThreadedServer
from tests.sim.test_sim_support import running

REAL = orjson.loads((STREAMS / "vllm-0.32" / "batch_chat_nonstream.json").read_bytes())
HELLO: Any = [{"role": "user", "content": "hello there"}]
OTHER: Any = [{"role": "user", "content": "a b c d e f"}]


@pytest.fixture(scope="module")
def sim() -> Iterator[tuple[ThreadedServer, SimApp]]:
    config = SimConfig(
        ttft=0.0, tokens_per_second=1000.0, output_tokens=5, per_request_metrics=True
    )
    with running(config) as pair:
        yield pair


def keys(body: dict[str, Any]) -> list[object]:
    """The body's members in order, each choice's and its message's."""
    choices = [(list(c), list(c["message"])) for c in body["choices"]]
    return [list(body), choices, list(body["usage"])]


def test_batch_chat_answers_a_choice_per_conversation_as_vllm_does(url: str) -> None:
    body = {"model": "sim-model", "messages": [HELLO, OTHER], "max_tokens": 5}
    reply = httpx.post(url + "/v1/chat/completions/batch", json=body)
    got = reply.json()
    assert reply.status_code == 200 and keys(got) == keys(REAL)
    assert got["object"] == REAL["object"] == "chat.completion"
    assert [c["index"] for c in got["choices"]] == [0, 1]
    assert got["id"].startswith("chatcmpl-") and got["metrics"] is REAL["metrics"] is None
    usage = got["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_batch_chat_ignores_stream_as_vllm_does(url: str) -> None:
    body = {"model": "sim-model", "messages": [HELLO], "stream": True}
    reply = httpx.post(url + "/v1/chat/completions/batch", json=body)
    assert reply.status_code == 200 and reply.headers["content-type"] == "application/json"
    assert reply.json()["object"] == "chat.completion"
    assert reply.json()["metrics"] is None  # one conversation, still no metrics


@pytest.mark.parametrize("messages", [[], [[]], HELLO, "hello"])
def test_batch_chat_refuses_what_is_no_list_of_conversations(url: str, messages: Any) -> None:
    reply = httpx.post(
        url + "/v1/chat/completions/batch", json={"model": "sim-model", "messages": messages}
    )
    assert reply.status_code == 400
