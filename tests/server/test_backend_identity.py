"""tokenprobe_backend_info: the proxy asks the upstream what it is, off the request path."""

from __future__ import annotations

import hashlib
import socket
import time
from collections.abc import Callable

import httpx

from proxy.core.measurement import TokenSource
from proxy.sim.app import create_sim_app
from proxy.sim.config import SimConfig
from proxy.sim.llamacpp import BUILD_INFO
from proxy.sim.ollama import OLLAMA_VERSION
from proxy.sim.utility import VLLM_VERSION
from tests.conftest import MODEL, ProxyUnderTest, Running
from tests.scrape import scrape
from tests.servers import ThreadedServer

REFRESH = 0.2


def backend_info(proxy: ProxyUnderTest, kind: str, version: str, timeout: float = 10.0) -> float:
    deadline = time.monotonic() + timeout
    value = 0.0
    while time.monotonic() < deadline:
        value = proxy.sample("tokenprobe_backend_info", kind=kind, version=version)
        if value:
            break
        time.sleep(0.05)
    return value


def test_a_simulated_vllm_is_vllm(
    start_sim: Callable[..., Running], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    proxy = start_proxy(start_sim().url, models_refresh=REFRESH)
    assert backend_info(proxy, "vllm", VLLM_VERSION) == 1


def test_a_simulated_ollama_is_ollama_and_an_upgrade_replaces_the_series(
    start_sim: Callable[..., Running], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    sim = start_sim(ollama_version=OLLAMA_VERSION)
    proxy = start_proxy(sim.url, models_refresh=REFRESH)
    assert backend_info(proxy, "ollama", OLLAMA_VERSION) == 1
    sim.app.config.ollama_version = "0.14.1"  # the backend was upgraded in place
    assert backend_info(proxy, "ollama", "0.14.1") == 1
    assert proxy.sample("tokenprobe_backend_info", kind="ollama", version=OLLAMA_VERSION) == 0


def test_a_dead_backend_is_unknown_and_delays_nothing(
    start_proxy: Callable[..., ProxyUnderTest],
) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    began = time.monotonic()
    proxy = start_proxy(f"http://127.0.0.1:{port}", models_refresh=REFRESH)
    answered = httpx.get(proxy.url + "/healthz", timeout=5)
    assert answered.status_code == 200 and time.monotonic() - began < 5
    assert backend_info(proxy, "unknown", "unknown") == 1


def test_a_llama_servers_requests_are_labelled_with_its_one_model_whatever_they_name(
    start_sim: Callable[..., Running], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """llama-server answers every request as its one model (native /completion names none,
    a chat may name any): the label is that model, not `other`, once the proxy knows the
    backend is llama.cpp and lists one model."""
    proxy = start_proxy(start_sim(backend_kind="llamacpp").url, models_refresh=REFRESH)
    assert backend_info(proxy, "llamacpp", BUILD_INFO) == 1
    deadline = time.monotonic() + 10  # and the model list, asked beside the kind
    while proxy.app.sinks.models("") != MODEL and time.monotonic() < deadline:
        time.sleep(0.05)
    program = {"x-sim-output-tokens": "2", "x-sim-ttft": "0.01"}
    native = httpx.post(
        proxy.url + "/completion",
        json={"prompt": "Hi", "n_predict": 2},
        headers=program,
        timeout=10,
    )
    chat = {"model": "gpt-4o", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    named = httpx.post(proxy.url + "/v1/chat/completions", json=chat, headers=program, timeout=10)
    assert (native.status_code, named.status_code) == (200, 200)
    proxy.wait_records(2)
    metrics = scrape(proxy.url)
    counts = {
        (endpoint, model): metrics.total(
            "tokenprobe_requests_total", endpoint=endpoint, model=model
        )
        for endpoint in ("/completion", "/v1/chat/completions")
        for model in (MODEL, "other")
    }
    assert counts == {
        ("/completion", MODEL): 1,
        ("/completion", "other"): 0,
        ("/v1/chat/completions", MODEL): 1,
        ("/v1/chat/completions", "other"): 0,
    }


# -- what the identity decides: Ollama's /v1/completions is not asked for usage ----------

# max_tokens leaves room for the EOS after the 6 tokens: the stream ends with its finish chunk
COMPLETION = {"model": MODEL, "prompt": "Once upon a time", "stream": True, "max_tokens": 7}
ZEROED = {"x-sim-usage-mode": "zeroed", "x-sim-output-tokens": "6", "x-sim-ttft": "0.02"}


def completion(proxy: ProxyUnderTest) -> bytes:
    with httpx.stream("POST", proxy.url + "/v1/completions", json=COMPLETION, headers=ZEROED) as r:
        return b"".join(r.iter_raw())


def test_an_ollama_is_not_asked_for_completion_usage_so_the_bytes_stay_direct(
    start_sim: Callable[..., Running], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    sim = start_sim(ollama_version=OLLAMA_VERSION, record_bodies=True)
    proxy = start_proxy(sim.url, models_refresh=REFRESH)
    assert backend_info(proxy, "ollama", OLLAMA_VERSION) == 1
    got = completion(proxy)
    sent = next(r for r in sim.app.state.requests() if r.path == "/v1/completions")
    assert "stream_options" not in sent.body  # the request went as the client sent it
    assert hashlib.sha256(got).hexdigest() == sent.body_sha256 and b'"usage"' not in got
    m = proxy.wait_records(1, exact=True)[0]
    # the chunks: 6 with text and the EOS's finish chunk
    assert m.ok and m.token_source is TokenSource.CHUNKS and m.output_tokens == 7


def test_a_backend_not_known_as_ollama_is_asked_once_then_left_alone(
    start_sim: Callable[..., Running], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    # The same stream shape from a backend that is not known as Ollama: the proxy asks,
    # and its first stream is reshaped (usage on every chunk, as the rule above keeps from
    # Ollama's clients). Usage beside choices is usage the proxy never asked for there, so
    # the stripper steps aside (the usage chunk too reaches the client) and the proxy asks
    # that upstream no more (proxy/core/strip.py): the next stream is the direct one.
    sim = start_sim(record_bodies=True)
    proxy = start_proxy(sim.url, models_refresh=REFRESH)
    assert backend_info(proxy, "vllm", VLLM_VERSION) == 1
    first = completion(proxy)
    asked = [r for r in sim.app.state.requests() if r.path == "/v1/completions"][-1]
    assert asked.body["stream_options"] == {"include_usage": True}
    zeroed = b'"usage":{"prompt_tokens":0,"completion_tokens":0,"total_tokens":0}'
    assert first.count(zeroed) == 6 and b'"choices":[],"usage"' in first
    second = completion(proxy)
    sent = [r for r in sim.app.state.requests() if r.path == "/v1/completions"][-1]
    assert "stream_options" not in sent.body
    assert hashlib.sha256(second).hexdigest() == sent.body_sha256 and b'"usage"' not in second
    one, two = proxy.wait_records(2, exact=True)
    assert one.token_source is TokenSource.USAGE and two.token_source is TokenSource.CHUNKS
    assert two.ok and two.output_tokens == 7  # the chunks: the EOS's finish chunk too


# -- the model list of a backend that comes up after the proxy ----------------------------


def test_a_backend_that_comes_up_after_the_proxy_has_its_models_labelled_within_seconds(
    start_proxy: Callable[..., ProxyUnderTest],
) -> None:
    """A proxy started beside a vLLM still loading its model: its first look at the model
    list fails, and it looked again only after --models-refresh (60 s by default), so the
    model was labelled `other` all that while (a review: 12 requests). It asks again after
    1 s, doubling, until it has the list."""
    sim_app = create_sim_app(SimConfig(models=("late-model",)))
    sim = ThreadedServer(sim_app)  # its port chosen, nothing listening on it yet
    proxy = start_proxy(sim.url, models_refresh=60.0, model_allowlist=())
    try:
        time.sleep(0.5)  # the first look has failed by now
        assert "late-model" not in proxy.app.sinks.models.known
        sim.start()
        deadline = time.monotonic() + 6
        while "late-model" not in proxy.app.sinks.models.known and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "late-model" in proxy.app.sinks.models.known
    finally:
        sim.stop()
