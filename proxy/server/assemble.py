"""Assemble the proxy from settings and the environment: the one place that builds parts.

In order: the registry and the Prometheus metrics, the label resolvers (models, API
keys), the sinks each finished request goes to, the tracer (OTEL_* variables), the
/metrics app (summing every worker's files in multi-process mode), the control plane;
then ProxyApp, which only routes and runs them. In a worker process this runs after the
fork, so exporters' connections and threads belong to the process that uses them.

A new sink is a class with `record(measurement, labels)` (proxy/sinks/sink.py) and one
line in `_sinks` below.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import httpx
from prometheus_client import CollectorRegistry

from proxy.core.conversations import Conversations
from proxy.core.labels import Ledger, ModelLabels
from proxy.core.slo import Policy, parse_slo
from proxy.core.wsrecord import WORKER_DIED
from proxy.server.app import ProxyApp
from proxy.server.control import ControlPlane, GuardedMetrics, Readiness
from proxy.server.exposition import Exposition
from proxy.server.ledger import FileLedger, ledger_path
from proxy.server.multiproc import MULTIPROC_ENV, multiprocess_metrics_app
from proxy.server.processfigures import ProcessFigures
from proxy.server.protocol import HeadGuard, connection_counter
from proxy.settings import Settings, label_pairs, load_slo_file
from proxy.sinks.conversations import ClosedListener, ConversationTracker
from proxy.sinks.cost import CostSink, export_cost_per_hour, load_prices
from proxy.sinks.dispatch import Sinks
from proxy.sinks.keys import KeyLabels
from proxy.sinks.logs import AccessLog, salt_key
from proxy.sinks.metrics import Metrics
from proxy.sinks.otel_env import metrics_requested, traces_requested
from proxy.sinks.sink import RequestTracer, Sink
from proxy.sinks.slo import SloMetrics
from proxy.types import ASGIApp


def assemble(
    settings: Settings,
    environ: Mapping[str, str],
    *,
    registry: CollectorRegistry | None = None,
    tracer: RequestTracer | None = None,
    extra_sinks: Sequence[Sink] = (),
    transport: httpx.AsyncBaseTransport | None = None,
) -> ProxyApp:
    """The proxy the settings ask for. `tracer` replaces the one OTEL_* would configure,
    `extra_sinks` record after the configured ones (the demo, tests), and `transport`
    replaces the upstream transport --upstream-transport picks for the ASGI relay's
    upstream client (an in-process test's scripted upstream, `httpx.MockTransport`)."""
    upstream = settings.upstream
    if registry is None:
        # ProcessFigures describes no names: a `name[]` scrape must still reach it.
        registry = CollectorRegistry(support_collectors_without_names=True)
        # The process's own figures under the usual names: process_cpu_seconds_total,
        # process_resident_memory_bytes, and process_open_fds against process_max_fds
        # (two a stream: docs/deployment.md, "Open files"). With --workers the
        # exposition is the workers' files (proxy/server/multiproc.py), holding none.
        registry.register(ProcessFigures())
    attribution = label_pairs(settings)
    metrics = Metrics(registry, tuple(label for _, label in attribution))
    models = ModelLabels(settings.model_allowlist)
    ledger = _ledgers(environ)
    if settings.cost_per_hour is not None:
        export_cost_per_hour(registry, settings.cost_per_hour, settings.currency)
    if tracer is None and traces_requested(environ):  # else the OTel SDK is not imported
        from proxy.sinks.tracing import tracing_from_env

        tracer = tracing_from_env(
            environ, upstream=upstream, registry=registry, trace_content=settings.trace_content
        )
    recording = [metrics, *_sinks(settings, registry, environ, metrics, models), *extra_sinks]
    sinks = Sinks(
        recording,
        metrics=metrics,
        models=models,
        keys=_keys(settings, ledger),
        tracer=tracer,
        attribution=attribution,
        max_label_values=settings.label_values,
        ledger=ledger,
        conversations=_conversations(settings, metrics, recording),
    )
    control = ControlPlane(
        GuardedMetrics(_exposition(registry, environ, metrics), settings.metrics_token),
        Readiness(upstream),
        apart=settings.metrics_port is not None,
    )
    return ProxyApp(
        settings,
        registry=registry,
        sinks=sinks,
        control=control,
        head_guard=HeadGuard.of(settings, connection_counter(registry)),
        transport=transport,
    )


def check_environment(environ: Mapping[str, str]) -> None:
    """What `assemble` reads besides the settings, the OTEL_* variables, parsed as it
    parses them without building an exporter: SettingsError naming a bad one. The parent
    of `--workers` asks before it starts any worker, which would each fail on it."""
    if traces_requested(environ):
        from proxy.sinks.tracing import check_tracing_env

        check_tracing_env(environ)
    if metrics_requested(environ):  # raises for an exporter it does not know
        from proxy.sinks.otlp.config import check_metrics_env

        check_metrics_env(environ)


def _ledgers(environ: Mapping[str, str]) -> Callable[[str], Ledger] | None:
    """Each bounded label's ledger by name, in the metrics directory several processes
    share (proxy/server/ledger.py); None in one process of its own, whose bounds are its
    own."""
    directory = environ.get(MULTIPROC_ENV)
    if not directory:
        return None
    return lambda label: FileLedger(ledger_path(directory, label))


def _keys(settings: Settings, ledger: Callable[[str], Ledger] | None) -> KeyLabels | None:
    if settings.key_label != "hash":
        return None
    return KeyLabels(settings.key_salt, ledger=ledger("key") if ledger else None)


def _sinks(
    settings: Settings,
    registry: CollectorRegistry,
    environ: Mapping[str, str],
    metrics: Metrics,
    models: ModelLabels,
) -> list[Sink]:
    """The sinks besides Metrics that the settings turn on, in the order they record."""
    sinks: list[Sink] = []
    labels = metrics.attribution
    if settings.access_log != "off":
        sinks.append(AccessLog(settings.access_log, attribution=labels, salt=settings.log_salt))
    if (policy := slo_policy(settings)) is not None:
        sinks.append(SloMetrics(registry, policy, labels))
    prices = load_prices(settings.prices) if settings.prices else None
    if prices is not None:
        sinks.append(CostSink(prices, registry))
    if metrics_requested(environ):  # OTEL_METRICS_EXPORTER=otlp; else not even imported
        from proxy.sinks.otlp import otlp_metrics_from_env

        sinks.append(
            otlp_metrics_from_env(
                environ,
                upstream=settings.upstream,
                registry=registry,
                models=models,
                attribution=labels,
                prices=prices,
                in_flight=metrics.in_flight,
                miss_ratio=settings.continuation_cache_miss_ratio,
            )
        )
    return sinks


def slo_policy(settings: Settings) -> Policy | None:
    """--slo and --slo-file as one Policy (the file's models, its default else --slo)."""
    default = parse_slo(settings.slo) if settings.slo else {}
    if settings.slo_file:
        policy = load_slo_file(settings.slo_file)
        return Policy(policy.default or default, policy.models)
    return Policy(default) if default else None


def _conversations(
    settings: Settings, metrics: Metrics, recording: Sequence[Sink]
) -> ConversationTracker:
    """The per-process conversation table; ids keyed with --log-salt (random without).
    The sinks that report closed conversations too (OTLP) are its listeners."""
    table = Conversations(
        capacity=settings.conversation_table,
        idle=settings.conversation_idle,
        salt=salt_key(settings.log_salt),
    )
    return ConversationTracker(
        table,
        metrics,
        header=settings.conversation_header,
        miss_ratio=settings.continuation_cache_miss_ratio,
        listeners=[sink for sink in recording if isinstance(sink, ClosedListener)],
    )


def _exposition(
    registry: CollectorRegistry, environ: Mapping[str, str], metrics: Metrics
) -> ASGIApp:
    """This process's registry, or with several workers every worker's values summed (and
    a dead worker's requests in flight counted as lost)."""
    directory = environ.get(MULTIPROC_ENV)
    if not directory:
        return Exposition(registry)

    def lost(model: str, endpoint: str, requests: float) -> None:
        metrics.requests_lost.labels(model, endpoint).inc(requests)

    def sessions_lost(route: str, sessions: float) -> None:
        metrics.ws.sessions.labels(route, WORKER_DIED).inc(sessions)

    return multiprocess_metrics_app(directory, lost, sessions_lost)
