"""The proxy's own endpoints under hostile requests: the --metrics-port listener keeps the
relay's head limits, no spelling of a backend's metrics mount passes --metrics-token by,
and the live view's page is served at one address only."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, make_asgi_app
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

from tests.conftest import ProxyUnderTest, Running
from tests.server.conftest import paths
from tests.servers import ThreadedServer, free_port, serve

LISTENER = "the --metrics-port listener is one app whatever --relay says"


def raw_get(port: int, target: bytes, timeout: float = 5.0) -> bytes:
    """One GET on its own connection, its answer read to the close."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % target)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


# -- the --metrics-port listener's head limits --------------------------------------------


@pytest.fixture
def apart(sim: Running, start_proxy: Callable[..., ProxyUnderTest]) -> int:
    """A proxy whose metrics are on a port of their own (returned), with small limits."""
    port = free_port()
    start_proxy(sim.url, metrics_port=port, max_header_bytes=1024, header_timeout=0.5)
    return port


@paths("wire", why=LISTENER)
def test_a_head_over_the_limit_to_the_metrics_port_is_cut_as_it_arrives(apart: int) -> None:
    line = b"x-a: " + b"a" * 1000 + b"\r\n"
    with socket.create_connection(("127.0.0.1", apart), timeout=5) as sock:
        try:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            for _ in range(4096):  # 4 MiB, far over 1024 bytes and HEAD_SLACK
                sock.sendall(line)
            sock.sendall(b"\r\n")
            answer = sock.recv(64)
        except ConnectionError:  # cut while it was sent (a timeout is no cut: it raises)
            answer = b""
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431"), answer


@paths("wire", why=LISTENER)
def test_a_slow_head_to_the_metrics_port_is_cut_at_the_header_timeout(apart: int) -> None:
    with socket.create_connection(("127.0.0.1", apart), timeout=5) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        started = time.monotonic()
        answer = sock.recv(64)
        assert time.monotonic() - started < 3
    assert answer.startswith(b"HTTP/1.1 408")


@paths("wire", why=LISTENER)
def test_unfinished_heads_do_not_keep_a_scrape_out(
    sim: Running, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """Connections are not requests: 80 heads left unfinished (more than the listener serves
    at once) still leave a scrape its answer. With uvicorn's limit_concurrency at 64, every
    scrape got 503 until --header-timeout cut them."""
    port = free_port()
    start_proxy(sim.url, metrics_port=port)  # --header-timeout 10 s: they stay meanwhile
    held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(80)]
    try:
        for sock in held:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        time.sleep(0.2)  # every one accepted and read
        answer = raw_get(port, b"/metrics")
    finally:
        for sock in held:
            sock.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer[:80]


# -- a backend that mounts its metrics as vLLM does -----------------------------------------


def vllm_like() -> Starlette:
    """vLLM 0.32's /metrics mount (vllm/entrypoints/serve/instrumentator/metrics.py,
    attach_router): every path that begins with /metrics answers the exposition."""
    registry = CollectorRegistry()
    Counter("backend_only_series", "a series only the backend has", registry=registry)

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "m"}]})

    metrics = Mount("/metrics", make_asgi_app(registry=registry))
    metrics.path_regex = re.compile("^/metrics(?P<path>.*)$")
    return Starlette(routes=[Route("/v1/models", models), metrics])


@pytest.fixture(scope="module")
def backend() -> Iterator[ThreadedServer]:
    with serve(vllm_like()) as server:
        yield server


SPELLINGS = [b"/metrics;x", b"/metricsX", b"/metrics.txt", b"/metrics%20", b"/metrics/x"]


@pytest.mark.parametrize("target", SPELLINGS)
def test_no_spelling_of_the_backends_metrics_mount_passes_the_token_by(
    backend: ThreadedServer, start_proxy: Callable[..., ProxyUnderTest], target: bytes
) -> None:
    assert b"backend_only_series" in raw_get(backend.port, target)  # the backend answers it
    proxy = start_proxy(backend.url, metrics_token="let-me-in")
    answer = raw_get(proxy.server.port, target)
    assert answer.startswith(b"HTTP/1.1 404") and b"backend_only_series" not in answer


def test_the_backends_metrics_pass_through_when_the_proxys_are_on_their_own_port(
    backend: ThreadedServer, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    proxy = start_proxy(backend.url, metrics_port=free_port(), metrics_token="let-me-in")
    assert b"backend_only_series" in raw_get(proxy.server.port, b"/metricsX")


# -- one address for the live view's page, one routing on both ports ------------------------


def test_the_live_view_page_asked_at_another_spelling_redirects_to_ui(
    sim: Running, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    proxy = start_proxy(sim.url)
    for target in (b"/ui/.", b"/ui/", b"//ui", b"/ui/x/.."):
        answer = raw_get(proxy.server.port, target)
        assert answer.startswith(b"HTTP/1.1 308") and b"\r\nlocation: /ui\r\n" in answer, target
    assert httpx.get(proxy.url + "/ui").status_code == 200


@paths("wire", why=LISTENER)
def test_the_metrics_port_routes_a_path_as_the_proxy_port_does(
    sim: Running, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    port = free_port()
    start_proxy(sim.url, metrics_port=port)
    for target in (b"//metrics", b"/metrics/", b"/v1/../metrics"):
        assert raw_get(port, target).startswith(b"HTTP/1.1 200"), target
    answer = raw_get(port, b"/ui/.")
    assert answer.startswith(b"HTTP/1.1 308") and b"\r\nlocation: /ui\r\n" in answer
    assert raw_get(port, b"/metricsX").startswith(b"HTTP/1.1 404")
