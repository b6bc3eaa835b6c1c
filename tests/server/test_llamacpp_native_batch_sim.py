"""llama.cpp's native `/completion` with a list of prompts, not streamed, through the proxy
in front of the simulator playing `llama-server` (proxy/sim/llamacpp_native.py), on both
data paths: the answer is a JSON array of last objects, one a prompt (llama-server's
server-context.cpp, handle_completions_impl), and it is measured as the stream is: the
prompts' counts added up, each prompt's finish its own. The real server:
tests/llamacpp/test_real_llamacpp.py.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from proxy.core.measurement import TokenSource
from tests.conftest import ProxyUnderTest, Running

TOKENS = 3
PROGRAM = {"x-sim-ttft": "0.01", "x-sim-tps": "500", "x-sim-output-tokens": str(TOKENS)}
BODY = {"prompt": ["hello there", "the quick brown fox jumps"], "n_predict": TOKENS}


@pytest.fixture
def sim(start_sim: Callable[..., Running]) -> Running:
    return start_sim(backend_kind="llamacpp")


@pytest.fixture
def proxy(sim: Running, start_proxy: Callable[..., ProxyUnderTest]) -> ProxyUnderTest:
    return start_proxy(sim.url)


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
def test_a_list_of_prompts_adds_up_every_prompts_counts(
    proxy: ProxyUnderTest, stream: bool
) -> None:
    with httpx.Client(timeout=30) as client:
        answer = client.post(
            proxy.url + "/completion", json={**BODY, "stream": stream}, headers=PROGRAM
        )
    assert answer.status_code == 200
    (m,) = proxy.wait_records(1, exact=True)
    assert (m.endpoint, m.stream, m.ok, m.token_source) == (
        "/completion",
        stream,
        True,
        TokenSource.ENGINE,
    )
    assert m.output_tokens == 2 * TOKENS
    if not stream:
        lasts = answer.json()
        assert [last["index"] for last in lasts] == [0, 1]
        assert m.prompt_tokens == sum(last["tokens_evaluated"] for last in lasts)
    assert (m.finish_reason, m.finish_reasons) == ("length", ("length", "length"))
