"""A dead trace collector or a slow scraper never slows or fails a request."""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Callable

import httpx
import pytest
from prometheus_client import CollectorRegistry

from proxy.core.measurement import Measurement
from proxy.server.assemble import assemble
from proxy.settings import Settings
from proxy.sinks.sink import Recorder
from proxy.sinks.tracing import tracing_from_env
from tests.conftest import MODEL, ProxyUnderTest, Running
from tests.servers import ThreadedServer, free_port

pytestmark = pytest.mark.quiet(
    "a request's latency is compared with and without a slow sink", seconds=3
)

CHAT = "/v1/chat/completions"
BODY = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
#: What is compared is the TTFT; the 10 tokens after it come fast (each request 60 ms in
#: all, not 100: 80 requests a run, with this whole machine held for them).
HEADERS = {"x-sim-ttft": "0.05", "x-sim-tps": "1000", "x-sim-output-tokens": "10"}


def ttfts(proxy_url: str, records: list[Measurement], n: int = 20) -> list[float]:
    first = len(records)
    with httpx.Client(timeout=10) as client:
        for _ in range(n):
            assert client.post(proxy_url + CHAT, json=BODY, headers=HEADERS).status_code == 200
    deadline = time.monotonic() + 5
    while len(records) < first + n and time.monotonic() < deadline:
        time.sleep(0.01)
    out = [m.ttft for m in records[first:] if m.ttft is not None]
    assert len(out) == n and all(m.error_type is None for m in records[first:])
    return out


def test_dead_otlp_collector_costs_requests_nothing(sim: Running, proxy: ProxyUnderTest) -> None:
    dead = free_port()  # nothing listens here
    registry = CollectorRegistry()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{dead}",
        "OTEL_BSP_SCHEDULE_DELAY": "20",  # export attempts happen during the requests
        "OTEL_EXPORTER_OTLP_TIMEOUT": "1",
    }
    tracer = tracing_from_env(env, upstream=sim.url, registry=registry)
    assert tracer is not None
    recorder = Recorder()
    records = recorder.records
    app = assemble(
        Settings(upstream=sim.url, model_allowlist=(MODEL,), models_refresh=None, access_log="off"),
        {},
        registry=registry,
        tracer=tracer,
        extra_sinks=[recorder],
    )
    traced = ThreadedServer(app, server_header=False, date_header=False).start()
    try:
        baseline = statistics.median(ttfts(proxy.url, proxy.records))
        with_dead_collector = statistics.median(ttfts(traced.url, records))
        # A blocked export would cost its 1 s timeout; a loaded box moves medians far less.
        assert with_dead_collector - baseline < 0.25
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if registry.get_sample_value(
                "tokenprobe_trace_export_failures_total", {"reason": "export"}
            ):
                break
            time.sleep(0.1)
        assert registry.get_sample_value(
            "tokenprobe_trace_export_failures_total", {"reason": "export"}
        )
    finally:
        traced.stop()


def test_slow_scrapers_do_not_slow_requests(
    sim: Running, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    proxy = start_proxy(sim.url)
    baseline = statistics.median(ttfts(proxy.url, proxy.records))
    scrapers = []
    for _ in range(5):  # scrapers that ask for /metrics and never read the answer
        sock = socket.create_connection(("127.0.0.1", proxy.server.port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        sock.sendall(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
        scrapers.append(sock)
    try:
        time.sleep(0.2)
        during = statistics.median(ttfts(proxy.url, proxy.records))
        # A blocked scrape would hold requests for good; a loaded box moves medians far less.
        assert during - baseline < 0.25
    finally:
        for sock in scrapers:
            sock.close()
