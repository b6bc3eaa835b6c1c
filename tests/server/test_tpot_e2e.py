"""TPOT through the proxy on every backend whose count includes the token that ends an
answer: vLLM's chat, Messages and Responses, llama-server's chat, Ollama's /api/chat.

Each backend counts the EOS after the text (vLLM's output token ids, llama-server's
`n_decoded`, Ollama's `eval_count`) and sends the finish at its decode step, one step
after the last text (the simulator plays each: proxy/sim/controls.py Plan.eos). So N text
tokens are N + 1 tokens and N gaps, and TPOT is one step only if the proxy's decode span
runs to the read of the finish (proxy/core/observe.py `_ending_reads`, docs/measured.md
"The token that ends an answer"): ended at the last text read it would be 3/4 of a step.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import MODEL, ProxyUnderTest, Running

TEXT_TOKENS = 4
TPS = 20.0
PROGRAM = {"x-sim-ttft": "0.05", "x-sim-tps": str(TPS), "x-sim-output-tokens": str(TEXT_TOKENS)}
MESSAGES: Any = [{"role": "user", "content": "Hello there"}]

#: (path, body, extra headers) of one streamed answer on each route.
ROUTES: dict[str, tuple[str, dict[str, Any], dict[str, str]]] = {
    "chat": ("/v1/chat/completions", {"messages": MESSAGES}, {}),
    "messages": ("/v1/messages", {"messages": MESSAGES, "max_tokens": 64}, {}),
    "responses": ("/v1/responses", {"input": "Hello there"}, {}),
    "llamacpp_chat": (
        "/v1/chat/completions",
        {"messages": MESSAGES},
        {"x-sim-backend-kind": "llamacpp"},
    ),
    "ollama_chat": ("/api/chat", {"messages": MESSAGES}, {}),
}


@pytest.mark.quiet("TPOT is read within 20% of the programmed step", seconds=1)
@pytest.mark.parametrize("route", list(ROUTES))
def test_tpot_runs_to_the_token_that_ended_the_answer(
    sim: Running, proxy: ProxyUnderTest, route: str
) -> None:
    path, body, headers = ROUTES[route]
    with httpx.stream(
        "POST",
        proxy.url + path,
        json={"model": MODEL, "stream": True, **body},
        headers={**PROGRAM, **headers},
    ) as r:
        assert r.status_code == 200
        for _ in r.iter_raw():
            pass
    (m,) = proxy.wait_records(1, exact=True)
    assert m.ok and m.finish_reason == "stop"
    assert m.output_tokens == TEXT_TOKENS + 1  # the text and the EOS, the backend's count
    assert m.content_events == TEXT_TOKENS
    # One step a token: ended at the last text read, the span would be 3 steps for 4 gaps
    # (0.75 of a step); a late first read shortens it (by 40 ms before this fails), a late
    # finish read lengthens it.
    assert m.tpot is not None and 0.8 < m.tpot * TPS < 1.2, m.tpot
