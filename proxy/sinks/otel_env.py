"""The standard OpenTelemetry SDK variables (OTEL_*), read once at start-up.

One home for what every signal shares: whether the SDK is disabled, which exporters a
signal names (`OTEL_TRACES_EXPORTER`, `OTEL_METRICS_EXPORTER`), where OTLP goes and how
(`OTEL_EXPORTER_OTLP_{SIGNAL}_*` first, then `OTEL_EXPORTER_OTLP_*`), and the service
name. Values are parsed with the settings' parsers (`proxy.settings.parse_value`), so a
bad one fails at start with the same message shape as a flag: the variable, its value,
what was expected.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from proxy.settings import SettingsError, number, parse_value, positive_int

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
    endpoint = env.get(_signal_key(signal, "ENDPOINT"))
    if endpoint is None:
        if protocol == "grpc":
            endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4317")
        else:
            base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4318")
            endpoint = base.rstrip("/") + _HTTP_PATHS[signal]
    timeout_key = _first_set(env, _signal_key(signal, "TIMEOUT"), "OTEL_EXPORTER_OTLP_TIMEOUT")
    return OtlpTarget(
        protocol=protocol,
        endpoint=endpoint,
        headers=_headers(env, signal),
        timeout=value(env, timeout_key, number, 10.0),
    )


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


def _headers(env: Mapping[str, str], signal: Signal) -> dict[str, str] | None:
    from opentelemetry.util.re import parse_env_headers

    raw = env.get(_signal_key(signal, "HEADERS")) or env.get("OTEL_EXPORTER_OTLP_HEADERS")
    return dict(parse_env_headers(raw, liberal=True)) if raw else None


def _signal_key(signal: Signal, what: str) -> str:
    return f"OTEL_EXPORTER_OTLP_{signal.upper()}_{what}"


def _first_set(env: Mapping[str, str], *keys: str) -> str:
    """The first of `keys` that is set, else the last (whose default then applies)."""
    return next((k for k in keys if k in env), keys[-1])
