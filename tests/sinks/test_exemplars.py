"""Exemplars: a traced request's trace id rides on its histogram observations, through
OpenMetrics /metrics, into a real Prometheus with exemplar storage."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from proxy.server.assemble import assemble
from proxy.settings import Settings
from proxy.sinks.tracing import Tracing
from tests.conftest import MODEL, Running
from tests.prom import Prometheus, require_binary
from tests.servers import ThreadedServer

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
EXEMPLAR = re.compile(
    r'^tokenprobe_time_to_first_token_seconds_bucket\{.*\} \S+ # \{trace_id="([0-9a-f]{32})"\}',
    re.M,
)


class TracedProxy:
    def __init__(self, url: str, spans: InMemorySpanExporter) -> None:
        self.url = url
        self.spans = spans

    def trace_ids(self) -> set[str]:
        return {format(s.context.trace_id, "032x") for s in self.spans.get_finished_spans()}

    def send(self, n: int) -> None:
        body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        with httpx.Client() as client:
            for _ in range(n):
                response = client.post(self.url + "/v1/chat/completions", json=body)
                assert response.status_code == 200


@pytest.fixture
def traced_proxy(sim: Running) -> Iterator[TracedProxy]:
    spans = InMemorySpanExporter()
    tracing = Tracing([SimpleSpanProcessor(spans)], upstream=sim.url)
    app = assemble(
        Settings(upstream=sim.url, models_refresh=None, model_allowlist=(MODEL,), access_log="off"),
        {},
        registry=CollectorRegistry(),
        tracer=tracing,
    )
    server = ThreadedServer(app, server_header=False, date_header=False).start()
    try:
        yield TracedProxy(server.url, spans)
    finally:
        server.stop()
        tracing.shutdown()


def test_openmetrics_scrape_carries_span_trace_ids_as_exemplars(traced_proxy: TracedProxy) -> None:
    traced_proxy.send(3)
    text = httpx.get(traced_proxy.url + "/metrics", headers={"Accept": OPENMETRICS}).text
    exemplars = set(EXEMPLAR.findall(text))
    assert exemplars and exemplars <= traced_proxy.trace_ids()


def test_plain_text_scrape_has_no_exemplars(traced_proxy: TracedProxy) -> None:
    traced_proxy.send(1)
    text = httpx.get(traced_proxy.url + "/metrics").text
    assert "tokenprobe_time_to_first_token_seconds_bucket" in text
    assert "trace_id" not in text


def test_prometheus_stores_the_trace_ids_of_traced_requests(
    traced_proxy: TracedProxy, tmp_path: Path
) -> None:
    require_binary("prometheus")
    target = traced_proxy.url.removeprefix("http://")
    with Prometheus(tmp_path, {"tokenprobe": [target]}) as prom:
        prom.wait_for_targets_up()
        start = time.time() - 60
        traced_proxy.send(3)
        deadline = time.monotonic() + 20
        found: set[str] = set()
        while not found and time.monotonic() < deadline:
            time.sleep(0.5)
            series = prom.query_exemplars(
                "tokenprobe_time_to_first_token_seconds_bucket", start, time.time() + 60
            )
            found = {
                e["labels"]["trace_id"]
                for s in series
                for e in s["exemplars"]
                if "trace_id" in e["labels"]
            }
    assert found, f"no exemplars after 20s:\n{prom.log_tail()}"
    # Each bucket keeps its latest exemplar, so some requests may be hidden; none invented.
    assert found <= traced_proxy.trace_ids()
