"""The control plane in-process: which paths are the proxy's own, and what each answers.

Driven through httpx's ASGI transport against the Starlette router alone: no server, no
relay. The end-to-end tests (test_security, test_ui, test_proxy_e2e) cover the same
routes on real sockets.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry

from proxy.core.errors import error_body
from proxy.server import control as control_module
from proxy.server.control import ControlPlane, GuardedMetrics, Readiness
from proxy.server.exposition import Exposition
from proxy.types import ASGIApp
from tests.server.conftest import no_proxy

pytestmark = no_proxy  # runs no proxy: once, on no data path

UPSTREAM = "http://upstream.test"


def control(*, apart: bool = False, token: str | None = None) -> ControlPlane:
    metrics = GuardedMetrics(Exposition(CollectorRegistry()), token)
    return ControlPlane(metrics, Readiness(UPSTREAM), apart=apart)


def call(
    app: ASGIApp, method: str, path: str, headers: dict[str, str] | None = None
) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy.test") as c:
            return await c.request(method, path, headers=headers)

    return asyncio.run(go())


def test_the_relays_paths_are_not_the_control_planes() -> None:
    plane = control()
    assert all(plane.owns(p) for p in ("/healthz", "/readyz", "/metrics", "/ui", "/ui/app.js"))
    assert not any(plane.owns(p) for p in ("/v1/chat/completions", "/", "/uix", "/healthzz"))
    # what vLLM's metrics mount answers (`^/metrics(?P<path>.*)$`) is the proxy's too
    assert all(plane.owns(p) for p in ("/metricsz", "/metrics;x", "/metrics/x"))


def test_with_a_metrics_port_only_the_probes_stay_on_the_proxy_port() -> None:
    plane = control(apart=True)
    assert plane.owns("/healthz") and plane.owns("/readyz")
    assert not any(plane.owns(p) for p in ("/metrics", "/ui", "/ui/app.js"))
    assert plane.listener is not None
    assert call(plane.listener, "GET", "/metrics").status_code == 200
    assert call(plane.listener, "GET", "/ui").status_code == 200
    elsewhere = call(plane.listener, "GET", "/healthz")
    assert elsewhere.status_code == 404
    assert elsewhere.content == error_body(
        404, "not_found", "only /metrics and /ui are served here"
    )


@pytest.mark.parametrize("method", ["GET", "HEAD", "POST", "DELETE"])
def test_healthz_answers_every_method(method: str) -> None:
    reply = call(control(), method, "/healthz")
    assert reply.status_code == 200
    assert reply.headers["content-type"] == "application/json"
    if method != "HEAD":
        assert reply.json() == {"status": "ok"}


def test_metrics_token_refusal_is_the_one_error_body() -> None:
    plane = control(token="let-me-in")
    refused = call(plane, "GET", "/metrics", headers={"authorization": "Bearer nope"})
    assert refused.status_code == 401
    assert refused.content == error_body(401, "auth", "metrics need a bearer token")
    allowed = call(plane, "GET", "/metrics", headers={"authorization": "Bearer let-me-in"})
    assert allowed.status_code == 200


@pytest.mark.parametrize(
    ("upstream_status", "ready", "status"), [(200, True, 200), (503, False, 503)]
)
def test_readyz_follows_the_upstream(upstream_status: int, ready: bool, status: int) -> None:
    plane = control()
    transport = httpx.MockTransport(lambda request: httpx.Response(upstream_status))
    plane.readiness.client = httpx.AsyncClient(transport=transport)
    reply = call(plane, "GET", "/readyz")
    # never the upstream's address: anyone who reaches the port may ask
    assert (reply.status_code, reply.json()) == (status, {"ready": ready})


def test_readyz_asks_once_for_all_its_callers_and_waits_a_bounded_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An upstream that never finishes answering: every caller has its answer within the
    probe's bound (a body dripping a byte every half second once kept it 50 s), and 20
    callers at once cost the upstream one request (they once opened 20 connections)."""
    monkeypatch.setattr(control_module, "PROBE_SECONDS", 0.3)
    asked: list[float] = []

    async def stalling(request: httpx.Request) -> httpx.Response:
        asked.append(time.monotonic())
        await asyncio.sleep(30)
        return httpx.Response(200)

    readiness = Readiness(UPSTREAM)

    async def many() -> list[bool]:
        readiness.client = httpx.AsyncClient(transport=httpx.MockTransport(stalling))
        return await asyncio.gather(*(readiness() for _ in range(20)))

    started = time.monotonic()
    answers = asyncio.run(many())
    assert answers == [False] * 20 and len(asked) == 1
    assert time.monotonic() - started < 2.0


def test_metrics_token_takes_the_scheme_in_any_case_and_a_refusal_names_it() -> None:
    plane = control(token="let-me-in")
    for given in ("bearer let-me-in", "BEARER let-me-in", "Bearer  let-me-in"):
        assert call(plane, "GET", "/metrics", headers={"authorization": given}).status_code == 200
    for given in ("Basic let-me-in", "let-me-in", "Bearer let-me-in-too"):
        refused = call(plane, "GET", "/metrics", headers={"authorization": given})
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
