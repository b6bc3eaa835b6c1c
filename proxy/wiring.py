"""Assemble the proxy from settings: which sinks, which registry, which /metrics."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, make_asgi_app

from proxy.app import ProxyApp, create_app
from proxy.measurement import Measurement
from proxy.settings import Settings
from proxy.types import Receive, Scope, Send


def build(settings: Settings, environ: Mapping[str, str]) -> ProxyApp:
    registry = CollectorRegistry()
    metrics_app: Any = None
    multiproc_dir = environ.get("PROMETHEUS_MULTIPROC_DIR")
    if multiproc_dir:
        metrics_app = _multiprocess_metrics_app(multiproc_dir)
    consumers: list[Callable[[Measurement, str], None]] = []
    tracer = None
    try:
        from proxy.logs import AccessLog
    except ImportError:  # pragma: no cover - during development
        AccessLog = None  # type: ignore[assignment,misc]  # noqa: N806
    if AccessLog is not None and settings.access_log != "off":
        consumers.append(AccessLog(settings.access_log))
    try:
        from proxy.tracing import tracing_from_env
    except ImportError:  # pragma: no cover
        tracing_from_env = None  # type: ignore[assignment]
    if tracing_from_env is not None:
        tracer = tracing_from_env(environ, trace_content=settings.trace_content, registry=registry, upstream=settings.upstream)  # type: ignore[call-arg]
    if settings.prices:
        from proxy.cost import CostSink, load_prices

        cost = CostSink(load_prices(settings.prices), registry)
        consumers.append(lambda m, _label: cost.record(m))
    return create_app(
        settings, registry=registry, tracer=tracer, consumers=consumers, metrics_app=metrics_app
    )


def _multiprocess_metrics_app(directory: str) -> Any:
    from prometheus_client import multiprocess

    from proxy.serve import drop_dead_workers

    scrape_registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(scrape_registry, path=directory)
    inner = make_asgi_app(scrape_registry)

    async def metrics(scope: Scope, receive: Receive, send: Send) -> None:
        drop_dead_workers(directory)
        await inner(scope, receive, send)

    return metrics



