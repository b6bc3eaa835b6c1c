"""llama-server's own paths (`/chat/completions`, `/completions`, `/completion`) are
measured only in front of a backend that may be llama-server: llama-server itself, or one
not identified (yet). In front of vLLM they are a client's wrong path (vLLM 0.32 answers
them 404): measured, each 404 counted in chat's error rate and its SLO's misses.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from proxy.server.admission import measured_api
from proxy.sim.llamacpp import BUILD_INFO
from proxy.sim.utility import VLLM_VERSION
from tests.conftest import MODEL, ProxyUnderTest, Running
from tests.scrape import REQUESTS, scrape, wait_for
from tests.server.conftest import no_proxy
from tests.server.test_backend_identity import backend_info

PASSTHROUGH = "tokenprobe_passthrough_requests_total"
CHAT = "/v1/chat/completions"
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BODIES = {
    "/chat/completions": CHAT_BODY,
    "/completions": {"prompt": "hi", "n_predict": 2},
    "/completion": {"prompt": "hi", "n_predict": 2},
}


@no_proxy
@pytest.mark.parametrize("path", [*sorted(BODIES), "/reranking", "/v1/reranking"])
def test_llama_servers_own_paths_are_measured_only_where_the_backend_may_be_it(path: str) -> None:
    assert measured_api("POST", path, "llamacpp") is not None
    assert measured_api("POST", path, "unknown") is not None  # not identified (yet)
    for kind in ("vllm", "sglang", "tgi", "ollama"):
        assert measured_api("POST", path, kind) is None, kind
    assert measured_api("GET", path, "llamacpp") is None


@no_proxy
def test_the_v1_paths_are_measured_in_front_of_any_backend() -> None:
    for kind in ("vllm", "llamacpp", "unknown", "ollama"):
        api = measured_api("POST", "/v1/chat/completions", kind)
        assert api is not None and api.endpoint == "/v1/chat/completions", kind
        api = measured_api("POST", "/v1/completions", kind)
        assert api is not None and api.endpoint == "/v1/completions", kind


def test_in_front_of_vllm_they_are_passthrough_and_count_in_no_apis_errors(
    start_sim: Callable[..., Running], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    proxy = start_proxy(start_sim(ttft=0.0, output_tokens=2).url, models_refresh=0.2)
    assert backend_info(proxy, "vllm", VLLM_VERSION) == 1
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        for path, body in BODIES.items():
            assert client.post(path, json=body).status_code == 404, path  # as vLLM answers
        assert client.post("/v1/chat/completions", json=CHAT_BODY).status_code == 200
    proxy.wait_records(1, timeout=30)
    page = wait_for(proxy.url, PASSTHROUGH, 3, route="/other", code="404")
    assert page.total(PASSTHROUGH, route="/other", code="404") == 3
    assert page.total(REQUESTS, code="404") == 0
    assert page.total(REQUESTS) == 1  # the /v1 one alone
    assert [r.endpoint for r in proxy.records] == ["/v1/chat/completions"]


def test_in_front_of_llama_server_they_are_measured(
    start_sim: Callable[..., Running], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """Each a record of its API's (the simulator playing llama-server serves the native
    two; its `/chat/completions` answer is a 404, recorded as chat's as any would be)."""
    sim = start_sim(backend_kind="llamacpp", ttft=0.0, output_tokens=2)
    proxy = start_proxy(sim.url, models_refresh=0.2)
    assert backend_info(proxy, "llamacpp", BUILD_INFO) == 1
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        for path, body in BODIES.items():
            client.post(path, json=body)
    records = proxy.wait_records(3, timeout=30)
    assert sorted((r.endpoint, r.status_code) for r in records) == [
        ("/completion", 200),
        ("/completion", 200),
        (CHAT, 404),
    ]
    assert scrape(proxy.url).total(PASSTHROUGH) == 0


def test_before_the_backend_is_known_they_are_measured(
    start_sim: Callable[..., Running], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """No answer to the proxy's questions yet (here none is ever asked): `unknown`, which
    a llama-server with --api-key stays, so its requests keep their measure."""
    sim = start_sim(backend_kind="llamacpp", ttft=0.0, output_tokens=2)
    proxy = start_proxy(sim.url)  # models_refresh None: the backend is never asked
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        assert client.post("/completion", json=BODIES["/completion"]).status_code == 200
    assert [r.endpoint for r in proxy.wait_records(1, timeout=30)] == ["/completion"]
