"""/metrics rendered in slices says exactly what prometheus-client would say at once."""

from __future__ import annotations

import asyncio
import gzip
from time import perf_counter

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

from proxy.server import exposition
from proxy.server.exposition import Exposition
from proxy.types import Message
from tests.server.conftest import no_proxy

pytestmark = no_proxy  # runs no proxy: once, on no data path

OPENMETRICS = b"application/openmetrics-text; version=1.0.0"


def large_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    counter = Counter("requests_total", "Requests.", ["model"], registry=registry)
    histogram = Histogram("ttft_seconds", "TTFT.", ["model"], registry=registry)
    gauge = Gauge("streams", "Open streams.", registry=registry)
    gauge.set(3)
    for i in range(3 * exposition.SLICE_SAMPLES):  # several slices per family
        counter.labels(f"m{i}").inc(i)
        histogram.labels(f"m{i}").observe(i / 100)
    return registry


def scrape(app: Exposition, accept: bytes, gz: bool = False, query: bytes = b"") -> bytes:
    messages: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request"}

    async def send(message: Message) -> None:
        messages.append(message)

    headers = [(b"accept", accept)] + ([(b"accept-encoding", b"gzip")] if gz else [])
    scope = {"type": "http", "headers": headers, "query_string": query}
    asyncio.run(app(scope, receive, send))  # type: ignore[arg-type]
    assert messages[0]["status"] == 200
    body: bytes = messages[1]["body"]
    return gzip.decompress(body) if gz else body


@pytest.mark.parametrize("accept", [b"text/plain", OPENMETRICS])
def test_sliced_render_equals_prometheus_clients(accept: bytes) -> None:
    registry = large_registry()
    expected = choose_encoder(accept.decode())[0](registry)
    assert scrape(Exposition(registry), accept) == expected
    assert scrape(Exposition(registry), accept, gz=True) == expected


def test_name_filter_and_fresh_values_for_each_scrape() -> None:
    registry = large_registry()
    app = Exposition(registry)
    only = scrape(app, b"text/plain", query=b"name[]=streams")
    assert only == b"# HELP streams Open streams.\n# TYPE streams gauge\nstreams 3.0\n"
    scrape(app, b"text/plain")
    registry._names_to_collectors["streams"].set(4)  # type: ignore[attr-defined]
    # Renders are paced, never reused: a scrape sees what was there when it arrived.
    assert b"\nstreams 4.0\n" in scrape(app, b"text/plain")


def test_scrapes_share_renders_and_one_pace_whatever_their_query_strings() -> None:
    """Any client can reach /metrics: varying the query string (`?r=<random>`) once gave
    each scrape a render and a pause of its own, and eight such scrapers took a whole
    core. Only `name[]` changes the page: the rest shares the render in flight, and a
    render for other names waits for the one pause all renders keep."""
    renders: list[float] = []
    app = Exposition(large_registry(), before=lambda: renders.append(perf_counter()))

    async def one(query: bytes) -> float:
        async def receive() -> Message:
            return {"type": "http.request"}

        async def send(message: Message) -> None:
            pass

        scope = {"type": "http", "headers": [(b"accept", b"text/plain")], "query_string": query}
        await app(scope, receive, send)  # type: ignore[arg-type]
        return perf_counter()

    async def scrapers() -> tuple[float, float]:
        ends = await asyncio.gather(*(one(b"r=%d" % i) for i in range(8)))
        named = await one(b"name[]=streams")  # another page: its own render, paced
        return max(ends), named

    ended, _ = asyncio.run(scrapers())
    assert len(renders) == 2, renders  # eight scrapes, one render; then the named one
    first_took = ended - renders[0]
    pause = min(first_took * (exposition.PACE_FACTOR - 1), exposition.MAX_PAUSE_SECONDS)
    assert renders[1] - ended >= pause * 0.5, (renders, ended)
