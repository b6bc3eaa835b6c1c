"""WebSocket sessions through `Sinks`: one record per tunnel (proxy/core/wsrecord.py) to
every sink that reports sessions, Prometheus, OTLP and the access log, failures caught.

The end-to-end case runs `tokenprobe serve` (a real process, the wire tunnelling) in front
of the `websockets` echo upstream, exporting OTLP metrics to an in-process receiver with
its JSON access log on a pipe, and reads one session and one refused target from all
three, against the same proxy's /metrics.
"""

from __future__ import annotations

import asyncio
import io
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from proxy.core.buckets import WS_SESSION_BUCKETS
from proxy.core.labels import ModelLabels
from proxy.core.wsrecord import WsSessionRecord
from proxy.sinks.dispatch import Sinks
from proxy.sinks.logs import SESSION_KEYS, AccessLog
from proxy.sinks.metrics import Metrics
from proxy.sinks.sink import Recorder
from tests.otlp_receiver import OtlpReceiver, ReceivedPoint, points
from tests.scrape import scrape
from tests.servers import free_port, serve, spawn, stop, wait_http
from tests.ws_upstream import EchoUpstream

SECRET = "sk-secret-do-not-log-4242"
RECORD = WsSessionRecord(
    route="/v1/realtime",
    outcome="closed_by_client",
    started_at=1_700_000_000.25,
    duration=1.5,
    status=101,
)


class _Broken:
    def record(self, measurement: Any, labels: Any) -> None: ...

    def session(self, record: WsSessionRecord) -> None:
        raise RuntimeError("this sink is broken")


def test_a_session_reaches_every_session_sink_and_a_failing_one_is_counted() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    recorder = Recorder()
    out = io.StringIO()
    log = AccessLog("json", stream=out)
    sinks = Sinks([metrics, _Broken(), log, recorder], metrics=metrics, models=ModelLabels(()))
    sinks.session_started(RECORD.route)
    gauge = "tokenprobe_websocket_sessions_in_flight"
    assert registry.get_sample_value(gauge, {"route": "/v1/realtime"}) == 1
    sinks.session_ended(RECORD)
    assert registry.get_sample_value(gauge, {"route": "/v1/realtime"}) == 0
    sessions = {"route": "/v1/realtime", "outcome": "closed_by_client"}
    assert registry.get_sample_value("tokenprobe_websocket_sessions_total", sessions) == 1
    duration = "tokenprobe_websocket_session_duration_seconds"
    assert registry.get_sample_value(duration + "_sum", {"route": "/v1/realtime"}) == 1.5
    # The broken sink is counted, and the sinks after it still ran.
    failures = "tokenprobe_measurement_failures_total"
    assert registry.get_sample_value(failures, {"stage": "sink"}) == 1
    assert recorder.sessions == [RECORD]
    assert orjson.loads(out.getvalue()) == {
        "ts": "2023-11-14T22:13:20.250Z",
        "arrival": 1_700_000_000.25,
        "kind": "websocket_session",
        "endpoint": "/v1/realtime",
        "status": 101,
        "outcome": "closed_by_client",
        "e2e_ms": 1500.0,
        "error": None,
    }
    assert tuple(orjson.loads(out.getvalue())) == SESSION_KEYS


def test_the_text_access_log_writes_a_session_as_logfmt() -> None:
    out = io.StringIO()
    AccessLog("text", stream=out).session(RECORD)
    assert out.getvalue() == (
        "ts=2023-11-14T22:13:20.250Z arrival=1700000000.25 kind=websocket_session "
        "endpoint=/v1/realtime status=101 outcome=closed_by_client e2e_ms=1500.0\n"
    )


def test_otlp_counts_a_session_like_prometheus() -> None:
    from opentelemetry.sdk.resources import Resource

    from proxy.sinks.otlp import (
        WS_SESSION_DURATION,
        WS_SESSIONS,
        OtlpMetrics,
        metric_export_failures,
    )

    sink = OtlpMetrics(
        exporter=None,  # type: ignore[arg-type]  # collect() only
        upstream="http://127.0.0.1:8000",
        failures=metric_export_failures(CollectorRegistry()),
        models=lambda m: m,
        resource=Resource.create({}),
    )
    sink.session(RECORD)
    sink.session(RECORD)
    data = sink.collect()
    assert data is not None
    (scope,) = data.resource_metrics[0].scope_metrics
    by_name = {m.name: m for m in scope.metrics}
    (counted,) = by_name[WS_SESSIONS.name].data.data_points
    assert counted.value == 2
    assert counted.attributes == {
        "tokenprobe.websocket.route": "/v1/realtime",
        "server.address": "127.0.0.1",
        "server.port": 8000,
        "tokenprobe.websocket.outcome": "closed_by_client",
    }
    (lasted,) = by_name[WS_SESSION_DURATION.name].data.data_points
    assert (lasted.count, lasted.sum) == (2, 3.0)
    assert tuple(lasted.explicit_bounds) == WS_SESSION_BUCKETS
    assert "tokenprobe.websocket.outcome" not in lasted.attributes


# -- end to end: `tokenprobe serve`, a real WebSocket client and upstream ----------------------


class _Served:
    """`tokenprobe serve` with OTLP metrics on and its JSON access log read as it comes."""

    def __init__(self, upstream: str, collector: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.process = spawn(
            "serve", "--upstream", upstream, "--port", str(self.port),
            "--access-log", "json", "--models-refresh", "0",
            env={
                "OTEL_METRICS_EXPORTER": "otlp",
                "OTEL_METRIC_EXPORT_INTERVAL": "100",
                "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": collector + "/v1/metrics",
                "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf",
            },
            stdout=subprocess.PIPE,
        )  # fmt: skip
        self.lines: list[dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()
        wait_http(self.base + "/healthz")

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(b"{"):
                self.lines.append(orjson.loads(line))

    def sample(self, name: str, **labels: str) -> float:
        return scrape(self.base).total(name, **labels)


@pytest.fixture(scope="module")
def echo() -> Iterator[EchoUpstream]:
    upstream = EchoUpstream().start()
    yield upstream
    upstream.stop()


async def _two_sessions(url: str) -> int:
    """One session the client closes, then one whose target cannot be normalised."""
    secret = {"Authorization": f"Bearer {SECRET}"}
    async with connect(url + "/v1/echo?token=" + SECRET, additional_headers=secret) as ws:
        await ws.send("hello")
        assert await ws.recv() == "hello"
    with pytest.raises(InvalidStatus) as refused:
        async with connect(url + "/v1/a%2Fb", additional_headers=secret):
            pass
    return refused.value.response.status_code


def _total(found: list[ReceivedPoint], metric: str, field: str, **attrs: Any) -> float:
    return sum(
        getattr(p, field)
        for p in found
        if p.metric == metric and all(p.attributes.get(k) == v for k, v in attrs.items())
    )


def test_a_session_through_the_proxy_is_on_metrics_in_otlp_and_in_the_access_log(
    echo: EchoUpstream,
) -> None:
    receiver = OtlpReceiver()
    with serve(receiver) as collector:
        proxy = _Served(echo.url.replace("ws://", "http://"), collector.url)
        try:
            url = proxy.base.replace("http://", "ws://")
            assert asyncio.run(asyncio.wait_for(_two_sessions(url), 60)) == 400
            sessions = "tokenprobe_websocket_sessions_total"

            def counted() -> bool:
                return proxy.sample(sessions) >= 2

            _wait(counted, "both sessions on /metrics")
            prom_sum = proxy.sample("tokenprobe_websocket_session_duration_seconds_sum")
            assert proxy.sample(sessions, route="other", outcome="closed_by_client") == 1
            assert proxy.sample(sessions, route="other", outcome="invalid_request_target") == 1
            assert proxy.sample("tokenprobe_websocket_sessions_in_flight") == 0

            def exported(requests: list[Any]) -> bool:
                found = points(requests[-1]) if requests else []
                return _total(found, "tokenprobe.websocket.sessions", "sum") >= 2

            found = points(receiver.metrics.wait_for(exported)[-1])
            _wait(lambda: len(proxy.lines) >= 2, "both session lines")
        finally:
            stop(proxy.process)
    # OTLP: the same counts and durations as /metrics.
    otlp = "tokenprobe.websocket.sessions"
    outcome = "tokenprobe.websocket.outcome"
    assert _total(found, otlp, "sum", **{outcome: "closed_by_client"}) == 1
    assert _total(found, otlp, "sum", **{outcome: "invalid_request_target"}) == 1
    duration = "tokenprobe.websocket.session.duration"
    assert _total(found, duration, "count", **{"tokenprobe.websocket.route": "other"}) == 2
    assert _total(found, duration, "sum") == pytest.approx(prom_sum, abs=1e-6)
    assert SECRET.encode() not in b"".join(receiver.metrics.raw)
    # The access log: one line per session, shaped like a request's, no secret.
    closed, bad = (line for line in proxy.lines if line.get("kind") == "websocket_session")
    assert (closed["endpoint"], closed["status"], closed["outcome"]) == (
        "other",
        101,
        "closed_by_client",
    )
    assert (bad["endpoint"], bad["status"], bad["outcome"]) == (
        "other",
        400,
        "invalid_request_target",
    )
    # why, in the words the client got, as an upstream failure's session line says it
    assert bad["error"] == "the request path contains an encoded slash (%2F)"
    assert "error" not in closed or closed["error"] is None
    assert closed["e2e_ms"] > 0 and closed["arrival"] <= bad["arrival"]
    assert (closed["e2e_ms"] + bad["e2e_ms"]) / 1000 == pytest.approx(prom_sum, abs=1e-5)
    assert SECRET not in orjson.dumps(proxy.lines).decode()


def _wait(condition: Any, what: str, timeout: float = 20.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
