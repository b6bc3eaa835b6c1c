"""The OTLP endpoints (proxy/sinks/otel_env.py): checked at start as --upstream is, and the
credentials they carry (a collector's `user:pass@`, `?api-key=`) in no log line.

urllib3 wrote every export's request line at DEBUG (`"POST /v1/traces?api-key=..."`); a
collector that was down had the exporter warn `url: /v1/traces?api-key=...` at the
default level; an endpoint with a mistyped scheme was taken, and every batch logged it
whole, password and all."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

import proxy.server.app  # noqa: F401 - what every server process imports: its log policy
from proxy.core.request import CHAT, RequestInfo
from proxy.settings import SettingsError
from proxy.sinks.otel_env import otlp_target
from proxy.sinks.tracing import Tracing, tracing_from_env
from tests.factories import measurement
from tests.otlp_receiver import OtlpReceiver
from tests.servers import free_port, serve


@pytest.mark.parametrize(
    ("variable", "endpoint", "reason"),
    [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "htps://u:LEAKPASS1@c:4318", "http:// or https://"),
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "collector:4318/v1/traces", "http:// or https://"),
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://u:LEAK#PASS2@c:4318", "bad port"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://u:LEAKPASS3@:4318", "with a host"),
    ],
)
def test_an_endpoint_the_exporter_cannot_send_to_is_refused_with_its_credentials_masked(
    variable: str, endpoint: str, reason: str
) -> None:
    with pytest.raises(SettingsError) as refused:
        otlp_target({variable: endpoint}, "traces")
    said = str(refused.value)
    assert said.startswith(f"{variable}=") and reason in said, said
    assert "LEAK" not in said, said


def test_a_grpc_target_without_a_scheme_is_passed_on_and_a_bad_url_is_refused() -> None:
    """gRPC takes `collector:4317` (the SDK passes it on, OTEL_EXPORTER_OTLP_INSECURE
    applies to it); a URL with an authority must be http or https, as for OTLP/HTTP."""
    grpc = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    target = otlp_target({**grpc, "OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4317"}, "traces")
    assert target.endpoint == "collector:4317"
    with pytest.raises(SettingsError, match="http:// or https://") as refused:
        otlp_target({**grpc, "OTEL_EXPORTER_OTLP_ENDPOINT": "htps://u:LEAKPASS4@c"}, "traces")
    assert "LEAK" not in str(refused.value)


def test_user_info_and_a_query_reach_the_exporter_as_given() -> None:
    """A collector behind basic auth or an `?api-key=` works: only what is shown is masked."""
    base = "https://u:p4ss@collector:4318?api-key=k"
    assert otlp_target({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": base}, "traces").endpoint == base


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        self.lines: list[str] = []
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.lines.append(self.format(record))


@contextlib.contextmanager
def every_line_at_debug() -> Iterator[_Lines]:
    """What `--log-level debug` writes: the root logger at DEBUG, every line formatted."""
    handler = _Lines()
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def one_span(environ: dict[str, str]) -> Tracing:
    """A tracer from `environ` that has ended one span and flushed it (or failed to)."""
    tracing = tracing_from_env(environ, upstream="http://vllm:8000", registry=CollectorRegistry())
    assert tracing is not None
    info = RequestInfo(
        CHAT, "m", stream=False, usage_requested=False, max_tokens=8, temperature=None
    )
    span, _, _ = tracing.start(info, [])
    tracing.finish(span, measurement())
    tracing.force_flush()
    return tracing


def test_a_collector_that_is_down_is_warned_of_without_the_endpoints_credentials() -> None:
    dead = free_port()  # nothing listens there
    environ = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": (
            f"http://collector:LEAKPASS5@127.0.0.1:{dead}/v1/traces?api-key=LEAKQUERY6&x=1"
        ),
        "OTEL_EXPORTER_OTLP_TIMEOUT": "3",  # one retry: the warning, then the error
    }
    with every_line_at_debug() as logged:
        one_span(environ).shutdown()
    warned = [line for line in logged.lines if "Transient error" in line]
    assert warned, logged.lines  # what the test is about was written
    assert "/v1/traces?api-key=[redacted]&x=1" in warned[0], warned
    assert not [line for line in logged.lines if "LEAK" in line]


def test_at_debug_no_export_writes_the_endpoints_query() -> None:
    receiver = OtlpReceiver()
    with serve(receiver) as collector, every_line_at_debug() as logged:
        endpoint = collector.url.replace("http://", "http://collector:LEAKPASS7@")
        environ = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint + "/v1/traces?api-key=LEAKQ8"}
        tracing = one_span(environ)
        receiver.wait_for(lambda spans: len(spans) == 1)
        tracing.shutdown()
    assert not [line for line in logged.lines if "LEAK" in line]
    chatter = [r.name for r in logged.records if r.name.startswith(("urllib3", "requests"))]
    assert chatter == []  # below WARNING, the HTTP library under the exporter says nothing


def test_a_traceback_logged_by_the_exporters_is_masked() -> None:
    url = "http://collector:LEAKPASS9@c:4318/v1/traces?api-key=LEAKQ10"
    otlp_target({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": url}, "traces")
    with every_line_at_debug() as logged:
        try:
            raise ConnectionError(f"No connection adapters were found for {url!r}")
        except ConnectionError:
            # as the SDK's export loop logs what an exporter raised
            logging.getLogger("opentelemetry.sdk._shared_internal").exception("export failed")
    assert "No connection adapters" in logged.lines[0]
    assert "LEAK" not in logged.lines[0], logged.lines[0]


def test_every_logger_of_an_exporter_and_its_http_library_masks() -> None:
    """The loggers are named in otel_env: a module's logger is made when it is imported,
    after the first target is read, so a module a newer SDK adds must be named there too.
    In a process of its own, as a server's: there the modules are imported in that order."""
    script = """
import logging
from prometheus_client import CollectorRegistry
from proxy.core.labels import ModelLabels
from proxy.sinks.otel_env import otlp_target
from proxy.sinks.otlp import otlp_metrics_from_env
from proxy.sinks.span_export import otlp_span_exporter

for protocol in ("http/protobuf", "grpc"):
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
           "OTEL_EXPORTER_OTLP_PROTOCOL": protocol, "OTEL_METRICS_EXPORTER": "otlp"}
    otlp_span_exporter(otlp_target(env, "traces")).shutdown()
    otlp_metrics_from_env(env, upstream="http://vllm:8000", registry=CollectorRegistry(),
                          models=ModelLabels()).shutdown()
writers = ("opentelemetry.exporter.otlp.proto.http", "opentelemetry.exporter.otlp.proto.grpc",
           "opentelemetry.exporter.otlp.common.http", "urllib3", "requests")
for name, logger in logging.root.manager.loggerDict.items():
    if name.startswith(writers) and isinstance(logger, logging.Logger):
        print(name, "masked" if logger.filters else "UNMASKED")
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    loggers = dict(line.split() for line in out.stdout.splitlines())
    assert "opentelemetry.exporter.otlp.proto.http.trace_exporter" in loggers, out.stdout
    assert [name for name, masked in loggers.items() if masked != "masked"] == []
