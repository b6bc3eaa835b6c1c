"""Assemble the proxy from settings: which sinks, which registry, which /metrics."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry

from proxy.core.measurement import Measurement
from proxy.server.app import ProxyApp, create_app
from proxy.server.exposition import Exposition
from proxy.settings import Settings, require_upstream
from proxy.sinks.logs import AccessLog
from proxy.sinks.tracing import tracing_from_env


def build(settings: Settings, environ: Mapping[str, str]) -> ProxyApp:
    """Every sink the settings ask for. In a worker process this runs after the fork,
    so exporters' connections and threads belong to the process that uses them."""
    registry = CollectorRegistry()
    consumers: list[Callable[[Measurement, str], None]] = []
    if settings.access_log != "off":
        consumers.append(AccessLog(settings.access_log))
    if settings.prices:
        from proxy.sinks.cost import CostSink, load_prices

        cost = CostSink(load_prices(settings.prices), registry)
        consumers.append(lambda m, _label: cost.record(m))
    tracer = tracing_from_env(
        environ,
        upstream=require_upstream(settings),
        registry=registry,
        trace_content=settings.trace_content,
    )
    metrics_app: Any = None
    multiproc_dir = environ.get("PROMETHEUS_MULTIPROC_DIR")
    if multiproc_dir:
        metrics_app = _multiprocess_metrics_app(multiproc_dir)
    return create_app(
        settings, registry=registry, tracer=tracer, consumers=consumers, metrics_app=metrics_app
    )


def _multiprocess_metrics_app(directory: str) -> Any:
    from prometheus_client import multiprocess

    from proxy.server.serve import drop_dead_workers

    scrape_registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(scrape_registry, path=directory)  # type: ignore[no-untyped-call]
    return Exposition(scrape_registry, before=lambda: drop_dead_workers(directory))
