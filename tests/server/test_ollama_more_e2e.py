"""Ollama's native paths through the proxy: the proxy's own errors there in Ollama's shape,
and the unmeasured native routes counted by their own route label.

Ollama's clients read an error as `{"error": "..."}` (ollama/ollama api/types.go
StatusError, api/client.go checkError; the `ollama` Python client's ResponseError takes
`["error"]`): an OpenAI-shaped body reached them as a dict where the message belongs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import ollama
import pytest

from proxy.bench.ports import free_port
from tests.conftest import MODEL, ProxyUnderTest, Running

LIMIT = 1000
COUNT = "tokenprobe_passthrough_requests_total"
MESSAGES: Any = [{"role": "user", "content": "x" * (2 * LIMIT)}]


@pytest.fixture
def dead_proxy(start_proxy: Callable[..., ProxyUnderTest]) -> ProxyUnderTest:
    return start_proxy(f"http://127.0.0.1:{free_port()}")  # nothing listens there


@pytest.fixture
def client(dead_proxy: ProxyUnderTest) -> Iterator[ollama.Client]:
    client = ollama.Client(host=dead_proxy.url)
    yield client
    client.close()  # type: ignore[no-untyped-call]  # ollama 0.6.3 leaves it untyped


def test_a_measured_paths_502_reaches_the_ollama_client_as_a_message(
    client: ollama.Client,
) -> None:
    with pytest.raises(ollama.ResponseError) as raised:
        client.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert raised.value.status_code == 502
    assert isinstance(raised.value.error, str) and raised.value.error.startswith("upstream: ")


def test_a_passthrough_paths_502_is_ollamas_shape(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as raised:
        client.list()  # GET /api/tags
    assert raised.value.status_code == 502
    assert isinstance(raised.value.error, str) and raised.value.error.startswith("upstream: ")


@pytest.mark.parametrize("path", ["/api/chat", "/api/blobs/sha256:" + "ab" * 32])
def test_an_oversized_body_is_refused_in_ollamas_shape(
    sim: Running, start_proxy: Callable[..., ProxyUnderTest], path: str
) -> None:
    proxy = start_proxy(sim.url, max_body_bytes=LIMIT)
    reply = httpx.post(proxy.url + path, json={"model": MODEL, "messages": MESSAGES})
    assert reply.status_code == 413
    assert reply.json() == {"error": f"request body over {LIMIT} bytes"}


def test_openai_paths_keep_openais_shape(dead_proxy: ProxyUnderTest) -> None:
    for path in ("/v1/chat/completions", "/v1/models", "/api"):  # /api itself is no Ollama route
        reply = httpx.post(dead_proxy.url + path, json={"model": MODEL})
        assert reply.status_code == 502
        assert reply.json()["error"]["type"] == "upstream_unreachable", path


def passthrough_count(proxy: ProxyUnderTest, route: str, want: float) -> float:
    """The count once it is `want` (a request is counted just after its answer's last
    byte), or what it is after 5 s."""
    deadline = time.monotonic() + 5
    while (now := proxy.sample(COUNT, route=route, code="404")) < want and (
        time.monotonic() < deadline
    ):
        time.sleep(0.02)
    return now


def test_ollamas_native_routes_are_counted_by_their_own_label(
    sim: Running, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    proxy = start_proxy(sim.url)
    digests = ["sha256:" + c * 64 for c in "abc"]
    for path in ("/api/tags", "/api/ps", "/api/show", *(f"/api/blobs/{d}" for d in digests)):
        httpx.head(proxy.url + path)
    for route in ("/api/tags", "/api/ps", "/api/show"):
        assert passthrough_count(proxy, route, 1) == 1, route
    assert passthrough_count(proxy, "/api/blobs/{id}", 3) == 3  # one label, any digest
    assert proxy.sample(COUNT, route="/other", code="404") == 0
