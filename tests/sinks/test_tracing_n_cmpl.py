"""`n_cmpl` is llama-server's name for the choices (tools/server/server-schema.cpp:62-64,
`n` its alias), not vLLM's, which ignores it: a span's gen_ai.request.choice.count is `n`
on the OpenAI routes and `n_cmpl` first on llama-server's own /completion. Client -> proxy
-> simulator, spans exported over OTLP/HTTP to a real receiver."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import MODEL
from tests.sinks.test_tracing_e2e import Traced, chat, receiver, traced_proxy

__all__ = ["receiver", "traced_proxy"]  # the fixtures, shared with test_tracing_e2e


def choice_count(traced: Traced, path: str, body: dict[str, Any]) -> object:
    response = httpx.post(traced.url + path, json=body, timeout=30)
    assert response.status_code == 200, response.text
    (span,) = traced.receiver.wait_for()
    return span.attributes.get("gen_ai.request.choice.count")


@pytest.mark.parametrize(
    ("asked", "count"),
    [({"n": 2, "n_cmpl": 3}, 2), ({"n_cmpl": 3}, None)],
    ids=["n-beside-n_cmpl", "n_cmpl-alone"],
)
def test_a_vllm_chat_s_choice_count_is_its_n_not_n_cmpl(
    traced_proxy: Traced, asked: dict[str, Any], count: int | None
) -> None:
    """vLLM answers `n` choices whatever `n_cmpl` says (it was the span's count: 3)."""
    assert choice_count(traced_proxy, "/v1/chat/completions", chat(**asked)) == count


def test_llama_server_s_own_completion_reads_n_cmpl_before_n(traced_proxy: Traced) -> None:
    """/completion is llama-server's alone: `n_cmpl` is its choices, `n` the fallback."""
    body = {"model": MODEL, "prompt": "hello", "n_predict": 4, "n_cmpl": 3, "n": 2}
    headers = {"x-sim-backend-kind": "llamacpp"}
    response = httpx.post(traced_proxy.url + "/completion", json=body, headers=headers)
    # the simulator's llama-server has one slot and refuses n_cmpl 3 as the real one
    # refuses n above its slots; the span reads the request all the same
    (span,) = traced_proxy.receiver.wait_for()
    assert response.status_code in (200, 400)
    assert span.attributes.get("gen_ai.request.choice.count") == 3
