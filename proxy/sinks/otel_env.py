"""The standard OpenTelemetry SDK variables (OTEL_*), read once at start-up.

One home for what every signal shares: whether the SDK is disabled, which exporters a
signal names (`OTEL_TRACES_EXPORTER`, `OTEL_METRICS_EXPORTER`), where OTLP goes and how
(`OTEL_EXPORTER_OTLP_{SIGNAL}_*` first, then `OTEL_EXPORTER_OTLP_*`), and the service
name. Values are parsed with the settings' parsers (`proxy.settings.parse_value`), so a
bad one fails at start with the same message shape as a flag: the variable, its value,
what was expected (a URL's credentials masked).

The endpoints and headers are checked here, before any SDK call, because the SDK's own
handling of a bad one writes it out: a header entry it cannot read is logged whole (with
its token) and dropped, so spans went out with no auth; an endpoint it cannot send to is
logged with its password at every batch. The credentials an endpoint carries (a
collector's `user:pass@`, `?api-key=`) are masked in what the exporters and the HTTP
library under them log (`_ExporterLogs`).
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from proxy.core.secrets import SECRET_HEADERS, mask_values, sent_credentials, url_credentials
from proxy.settings import SettingsError, http_url, number, parse_value, positive_int

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource

Signal = Literal["traces", "metrics"]

#: The OTLP/HTTP path of each signal, appended to OTEL_EXPORTER_OTLP_ENDPOINT.
_HTTP_PATHS: dict[Signal, str] = {"traces": "/v1/traces", "metrics": "/v1/metrics"}
_PROTOCOLS = ("http/protobuf", "grpc")


@dataclass(frozen=True, slots=True)
class OtlpTarget:
    """Where and how one signal's OTLP exporter sends."""

    protocol: str  # http/protobuf or grpc
    endpoint: str
    headers: dict[str, str] | None
    timeout: float  # seconds


def otel_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The OTEL_* variables that are set to something (values stripped)."""
    return {k: v.strip() for k, v in environ.items() if k.startswith("OTEL_") and v.strip()}


def exporters(env: Mapping[str, str], signal: Signal) -> list[str]:
    """The exporters OTEL_{SIGNAL}_EXPORTER names (lower case); [] when the SDK is disabled
    or the variable says none; ["otlp"] when only an OTLP endpoint is set. `traces` are on
    with an endpoint alone (the SDK's default); `metrics` only when asked by name, so an
    endpoint set for traces turns on nothing more."""
    key = f"OTEL_{signal.upper()}_EXPORTER"
    names = [n.strip().lower() for n in env.get(key, "").split(",") if n.strip()]
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true" or "none" in names:
        return []
    if names:
        return names
    endpoint_set = "OTEL_EXPORTER_OTLP_ENDPOINT" in env or _signal_key(signal, "ENDPOINT") in env
    return ["otlp"] if signal == "traces" and endpoint_set else []


def traces_requested(environ: Mapping[str, str]) -> bool:
    """Whether the OTEL_* variables ask for traces: tracing_from_env's first question,
    asked before proxy/sinks/tracing.py (and the OpenTelemetry SDK under it) is imported."""
    return bool(exporters(otel_env(environ), "traces"))


def metrics_requested(environ: Mapping[str, str]) -> bool:
    """Whether OTEL_METRICS_EXPORTER asks for OTLP (or console) metrics. Prometheus is
    always on, so `prometheus` there asks for nothing more; an unknown name is refused."""
    names = exporters(otel_env(environ), "metrics")
    unknown = [n for n in names if n not in ("otlp", "console", "prometheus")]
    if unknown:
        raise SettingsError(
            f"OTEL_METRICS_EXPORTER={unknown[0]!r}: expected otlp, console, prometheus or none"
        )
    return "otlp" in names or "console" in names


def otlp_target(env: Mapping[str, str], signal: Signal) -> OtlpTarget:
    """The OTLP exporter's protocol, endpoint, headers and timeout for `signal`."""
    protocol_key = _first_set(env, _signal_key(signal, "PROTOCOL"), "OTEL_EXPORTER_OTLP_PROTOCOL")
    protocol = env.get(protocol_key, "http/protobuf")
    if protocol not in _PROTOCOLS:
        raise SettingsError(f"{protocol_key}={protocol!r}: expected http/protobuf or grpc")
    check = _grpc_endpoint if protocol == "grpc" else _http_endpoint
    endpoint_key = _first_set(env, _signal_key(signal, "ENDPOINT"), "OTEL_EXPORTER_OTLP_ENDPOINT")
    default = "http://localhost:4317" if protocol == "grpc" else "http://localhost:4318"
    endpoint: str = value(env, endpoint_key, check, default)
    if protocol != "grpc" and endpoint_key == "OTEL_EXPORTER_OTLP_ENDPOINT":
        endpoint = endpoint.rstrip("/") + _HTTP_PATHS[signal]  # a base URL
    timeout_key = _first_set(env, _signal_key(signal, "TIMEOUT"), "OTEL_EXPORTER_OTLP_TIMEOUT")
    target = OtlpTarget(
        protocol=protocol,
        endpoint=endpoint,
        headers=_headers(env, signal),
        timeout=value(env, timeout_key, number, 10.0),
    )
    # Every exporter is built from a target: what it carries is masked in their logs from
    # here on (the --workers parent checks the variables through here too: harmless).
    _EXPORTER_LOGS.mask(target)
    return target


def service_name(env: Mapping[str, str]) -> str:
    if name := env.get("OTEL_SERVICE_NAME"):
        return name
    for item in env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        key, _, raw = item.partition("=")
        if key.strip() == "service.name" and raw.strip():
            return raw.strip()
    return "tokenprobe"


_instance: tuple[int, str] | None = None


def instance_id() -> str:
    """This process's `service.instance.id`: a random UUID, new in each worker process
    (checked by pid, so a forked worker never keeps its parent's)."""
    global _instance
    if _instance is None or _instance[0] != os.getpid():
        _instance = (os.getpid(), str(uuid.uuid4()))
    return _instance[1]


def resource(env: Mapping[str, str]) -> Resource:
    """service.name and this process's service.instance.id (OTEL_RESOURCE_ATTRIBUTES
    merged by the SDK), so a collector tells several workers' series apart and sums them."""
    from opentelemetry.sdk.resources import Resource

    return Resource.create(
        {"service.name": service_name(env), "service.instance.id": instance_id()}
    )


def value(env: Mapping[str, str], key: str, parse: Callable[[str], Any], default: Any) -> Any:
    """`env[key]` parsed, or `default` when unset; a bad value is a SettingsError naming it."""
    return default if key not in env else parse_value(key, env[key], parse)


def count(env: Mapping[str, str], key: str, default: int) -> int:
    """A whole number of at least 1 (queue sizes, batch sizes, delays in ms)."""
    result: int = value(env, key, positive_int, default)
    return result


def _http_endpoint(text: str) -> str:
    """An OTLP/HTTP endpoint: an http:// or https:// URL with a host (what the exporter's
    HTTP library sends to). User info and a query are kept: a collector may take them."""
    http_url(text)
    return text


def _grpc_endpoint(text: str) -> str:
    """An OTLP/gRPC endpoint: a URL with a host (`//host`) is one `_http_endpoint` takes; a
    target without one (`collector:4317`, `dns:///collector:4317`) goes to gRPC as the SDK
    passes it."""
    return _http_endpoint(text) if urlsplit(text).netloc else text


#: One entry of OTEL_EXPORTER_OTLP_*HEADERS as the SDK reads it (opentelemetry-api's
#: opentelemetry/util/re.py, `parse_env_headers(liberal=True)`, as the exporters call it):
#: a name, `=`, and a value of printable ASCII without `"`, `,`, `;` or `\`; entries apart
#: with `,`. tests/sinks/test_otel_env_headers.py holds the two to the same answers.
_HEADER_ENTRY = re.compile(
    r"[ \t]*[\x21\x23-\x27\x2a\x2b\x2d\x2e\x30-\x39\x41-\x5a\x5e-\x7a\x7c\x7e]+[ \t]*"
    r"=[ \t]*[\x20\x21\x23-\x2b\x2d-\x3a\x3c-\x5b\x5d-\x7e]*[ \t]*"
)
_HEADER_SEPARATOR = re.compile(r"[ \t]*,[ \t]*")


def _headers(env: Mapping[str, str], signal: Signal) -> dict[str, str] | None:
    from opentelemetry.util.re import parse_env_headers

    for key in (_signal_key(signal, "HEADERS"), "OTEL_EXPORTER_OTLP_HEADERS"):
        _check_headers(key, env.get(key, ""))
    raw = env.get(_signal_key(signal, "HEADERS")) or env.get("OTEL_EXPORTER_OTLP_HEADERS")
    return dict(parse_env_headers(raw, liberal=True)) if raw else None


def _check_headers(key: str, raw: str) -> None:
    """Refuses an entry the SDK cannot read, by its number: the SDK logs it whole, token
    and all, before tokenprobe's logging is set up, drops it, and parses the variable again
    in the exporter (logged twice), so spans went out without their auth."""
    entries = [e for e in _HEADER_SEPARATOR.split(raw) if e]
    for number_, entry in enumerate(entries, 1):
        if not _HEADER_ENTRY.fullmatch(entry.strip()):
            raise SettingsError(
                f"{key}: entry {number_} of {len(entries)} is not NAME=VALUE (a name, `=`, "
                'then the value, percent-encoded where it holds `"`, `,`, `;` or `\\`: '
                "`Authorization=Bearer%20TOKEN`; entries apart with `,`); its text is not "
                "shown, as it may hold a credential"
            )


#: The loggers that write an OTLP exporter's endpoint (its path and query, or all of it)
#: or an exception that holds it: the exporters, the SDK's export loops, and the HTTP
#: library under OTLP/HTTP. Named, as well as found under `_WRITERS`: a module's logger
#: is made when it is imported, which is after the first target is read.
_WRITERS = ("opentelemetry.exporter", "urllib3", "requests")
_EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.common.http",
    "opentelemetry.exporter.otlp.proto.http._common",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "opentelemetry.exporter.otlp.proto.grpc.metric_exporter",
    "opentelemetry.sdk._shared_internal",
    "opentelemetry.sdk.trace.export",
    "opentelemetry.sdk.metrics._internal.export",
    "urllib3",
    "urllib3.connectionpool",
    "urllib3.connection",
    "urllib3.poolmanager",
    "urllib3.response",
    "urllib3.util.retry",
    "requests",
)


class _ExporterLogs(logging.Filter):
    """Masks, in the exporters' log lines, the credentials their targets carry: the
    endpoint's user info and credential parameters (`url_credentials`) and the headers'
    (`sent_credentials`), wherever they appear (`url: /v1/traces?api-key=...` when a
    collector is down; an exception's text). Known values, not patterns: each library
    writes the URL its own way. A record's traceback is written here, masked, for the
    handler's formatter to use as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.values: frozenset[str] = frozenset()

    def mask(self, target: OtlpTarget) -> None:
        headers = (target.headers or {}).items()
        pairs = [(k.lower().encode(), v.encode("latin-1", "replace")) for k, v in headers]
        found = [*url_credentials(target.endpoint), *sent_credentials(pairs, SECRET_HEADERS)]
        # replaced whole, never changed in place: an export thread may be reading it
        self.values = self.values.union(found)
        made = [name for name in list(logging.root.manager.loggerDict) if name.startswith(_WRITERS)]
        for name in {*_EXPORTER_LOGGERS, *made}:
            logger = logging.getLogger(name)
            if self not in logger.filters:
                logger.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.values:
            return True
        message = record.getMessage()
        masked = mask_values(message, self.values)
        if masked != message:
            record.msg, record.args = masked, None
        if record.exc_info and not record.exc_text:
            text = logging.Formatter().formatException(record.exc_info)
            record.exc_text = mask_values(text, self.values)
        return True


_EXPORTER_LOGS = _ExporterLogs()


def _signal_key(signal: Signal, what: str) -> str:
    return f"OTEL_EXPORTER_OTLP_{signal.upper()}_{what}"


def _first_set(env: Mapping[str, str], *keys: str) -> str:
    """The first of `keys` that is set, else the last (whose default then applies)."""
    return next((k for k in keys if k in env), keys[-1])
