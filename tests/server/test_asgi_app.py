"""The ASGI app as a product: `proxy.asgi:app` under hypercorn, configured from TOKENPROBE_*.

The same relay and measuring as `tokenprobe serve --relay asgi`, under a server that is
not uvicorn; a WebSocket gets a clean refusal there (only the wire tunnels them). These
tests run the factory itself, so they run once, on the ASGI relay's turn.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
import websockets.sync.client
from websockets.exceptions import InvalidStatus

from tests.conftest import MODEL, Running
from tests.scrape import scrape
from tests.server.conftest import paths
from tests.servers import free_port, stop, wait_http

CHAT = "/v1/chat/completions"
pytestmark = paths("asgi", why="the app factory is the ASGI relay")


@pytest.fixture
def hypercorn_app(sim: Running) -> Iterator[str]:
    port = free_port()
    env = {
        "TOKENPROBE_UPSTREAM": sim.url,
        "TOKENPROBE_MODELS_REFRESH": "0",
        "TOKENPROBE_MODEL_ALLOWLIST": MODEL,
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "hypercorn", "proxy.asgi:app", "--bind", f"127.0.0.1:{port}"],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/healthz")
        yield base
    finally:
        stop(process)


def test_the_app_factory_relays_and_measures_under_hypercorn(hypercorn_app: str) -> None:
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream("POST", hypercorn_app + CHAT, json=body, timeout=30) as response:
        streamed = b"".join(response.iter_raw())
    assert response.status_code == 200
    assert streamed.endswith(b"data: [DONE]\n\n") and b'"usage"' not in streamed
    first = scrape(hypercorn_app).series("tokenprobe_requests_total", error_type="none")[0]
    assert first.value == 1.0 and first.labels["model"] == MODEL


def test_uvicorns_access_line_keeps_the_path_and_masks_a_key_in_the_query(sim: Running) -> None:
    """The documented `uvicorn --factory proxy.asgi:create_app` (docs/architecture.md) logs
    each request line through `uvicorn.access`, with its query: `?api_key=` went to the
    log as sent. The key's value is masked; the path and the other parameters stay."""
    port = free_port()
    env = {
        "TOKENPROBE_UPSTREAM": sim.url,
        "TOKENPROBE_MODELS_REFRESH": "0",
        "TOKENPROBE_MODEL_ALLOWLIST": MODEL,
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory", "proxy.asgi:create_app",
         "--port", str(port)],
        env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/healthz")
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        sent = httpx.post(base + CHAT + "?api_key=ACCESSLEAK1&tenant=a", json=body, timeout=30)
        assert sent.status_code == 200, sent.text
        assert httpx.get(base + "/v1/models?key=ACCESSLEAK2", timeout=30).status_code == 200
    finally:
        stop(process)
    assert process.stdout is not None
    logged = process.stdout.read().decode()
    assert f'"POST {CHAT}?api_key=***&tenant=a HTTP/1.1" 200' in logged, logged
    assert '"GET /v1/models?key=*** HTTP/1.1" 200' in logged, logged
    assert "ACCESSLEAK" not in logged, logged


def test_a_websocket_gets_a_clean_refusal_from_the_asgi_app(hypercorn_app: str) -> None:
    url = hypercorn_app.replace("http://", "ws://") + "/v1/realtime"
    with pytest.raises(InvalidStatus) as refused:
        websockets.sync.client.connect(url, open_timeout=10)
    assert refused.value.response.status_code == 403
