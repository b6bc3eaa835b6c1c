"""`X-Conversation-Id` keeps usage out of a stream only in front of a backend that may
replay the stream by it (proxy/server/admission.py, `MAY_REPLAY`): llama-server, whose
`GET /v1/stream` replay would carry an injected usage chunk the client never got.

In front of vLLM the header turned usage injection off all the same: with speculative
decoding (several tokens a chunk) a stream sent with it was counted from its chunks, 8
output tokens for vLLM's 33. Both backends are the simulator, identified as the proxy
identifies the real ones (vLLM's /version, llama-server's /props), on both data paths.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest

from proxy.core.measurement import TokenSource
from proxy.sim.llamacpp import BUILD_INFO
from proxy.sim.state import SimRequest
from tests.conftest import MODEL, ProxyUnderTest, Running

CHAT = "/v1/chat/completions"
STREAM = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
#: Four tokens a chunk: a count of chunks is a quarter of the tokens.
SPEC = {"x-sim-spec-tokens": "3", "x-sim-acceptance-rate": "1.0", "x-sim-output-tokens": "24"}
CONVERSATION = {"x-conversation-id": "conv-1"}


def identified(
    start_proxy: Callable[..., ProxyUnderTest], sim: Running, kind: str
) -> ProxyUnderTest:
    """A proxy in front of `sim` once it knows the backend's kind (its background probe)."""
    proxy = start_proxy(sim.url, models_refresh=0.2)
    version = "0.32.0+sim" if kind == "vllm" else BUILD_INFO
    deadline = time.monotonic() + 10
    while not proxy.sample("tokenprobe_backend_info", kind=kind, version=version):
        assert time.monotonic() < deadline, f"the proxy never saw a {kind}"
        time.sleep(0.05)
    return proxy


def stream(proxy: ProxyUnderTest, headers: dict[str, str]) -> bytes:
    with httpx.stream("POST", proxy.url + CHAT, json=STREAM, headers=headers, timeout=30) as r:
        assert r.status_code == 200, r.read()
        return b"".join(r.iter_raw())


def chat(sim: Running) -> SimRequest:
    """The stream's request as the backend got it (the proxy's probes come and go beside)."""
    (request,) = [r for r in sim.app.state.requests() if r.path == CHAT]
    return request


def asked_for_usage(sim: Running) -> bool:
    return "stream_options" in chat(sim).body


def test_in_front_of_vllm_a_conversation_id_still_gets_usage(
    start_sim: Callable[..., Running], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    sim = start_sim(ttft=0.01, tokens_per_second=400.0)
    proxy = identified(start_proxy, sim, "vllm")
    got = stream(proxy, {**SPEC, **CONVERSATION})
    assert asked_for_usage(sim)
    assert b'"usage"' not in got  # taken out again: the client asked for none
    record = proxy.wait_records(1, exact=True)[0]
    assert record.token_source == TokenSource.USAGE
    assert record.output_tokens == chat(sim).completion_tokens


@pytest.mark.parametrize("headers", [CONVERSATION, {}], ids=["conversation", "none"])
def test_in_front_of_llama_server_only_a_conversation_id_keeps_usage_out(
    start_sim: Callable[..., Running],
    start_proxy: Callable[..., ProxyUnderTest],
    headers: dict[str, str],
) -> None:
    """llama-server replays a stream by its conversation id: that one goes as it came."""
    sim = start_sim(backend_kind="llamacpp", ttft=0.01, tokens_per_second=400.0)
    proxy = identified(start_proxy, sim, "llamacpp")
    stream(proxy, headers)
    assert asked_for_usage(sim) == (headers != CONVERSATION)
