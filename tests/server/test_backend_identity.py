"""tokenprobe_backend_info: the proxy asks the upstream what it is, off the request path."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import httpx

from proxy.sim.ollama import OLLAMA_VERSION
from proxy.sim.utility import VLLM_VERSION
from tests.conftest import ProxyUnderTest, Running

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
