"""A realtime session the backend refuses for its key, through the proxy's tunnel.

The simulator answers an upgrade without its API key as vLLM does (an HTTP 401 to the
handshake, tests/sim/test_sim_realtime.py); the tunnel relays that answer as sent and
counts the session `refused`. A refused handshake has no turn, but it is recorded as the
HTTP relay records a refused request (proxy/server/tunnel/session.py `_refused`): an
`auth` error, its made-up key `rejected` (never its own hash)."""

from __future__ import annotations

import time
from collections.abc import Callable

from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from proxy.core.measurement import ErrorType
from tests.conftest import ProxyUnderTest, Running
from tests.server.conftest import paths


@paths("wire", why="the wire tunnels WebSockets; the ASGI app refuses them")
def test_a_realtime_session_with_a_made_up_key_is_refused_and_labels_nothing(
    start_sim: Callable[..., Running], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    sim = start_sim(api_key="good")
    proxy = start_proxy(sim.url, key_label="hash", key_salt="s")
    url = proxy.url.replace("http://", "ws://") + "/v1/realtime"
    try:
        with connect(url, additional_headers={"authorization": "Bearer made-up"}, open_timeout=10):
            raise AssertionError("the upgrade was accepted")
    except InvalidStatus as refused:
        assert refused.response.status_code == 401
        assert bytes(refused.response.body or b"") == b'{"error":"Unauthorized"}'
    (record,) = proxy.wait_records(1, exact=True)
    assert (record.endpoint, record.status_code, record.error_type) == (
        "/v1/realtime",
        401,
        ErrorType.AUTH,
    )
    assert record.error_message == "Unauthorized" and record.ttfb is not None
    refusals = {"route": "/v1/realtime", "outcome": "refused"}
    deadline = time.monotonic() + 5  # counted once both connections closed
    while not proxy.sample("tokenprobe_websocket_sessions_total", **refusals):
        assert time.monotonic() < deadline, "the refused session was not counted"
        time.sleep(0.01)
    series = [
        sample.labels
        for metric in proxy.registry.collect()
        if metric.name == "tokenprobe_key_requests"
        for sample in metric.samples
        if sample.name.endswith("_total")
    ]
    assert series == [{"key": "rejected", "model": "other", "error_type": "auth"}]
    assert sim.app.realtime_sessions == []
