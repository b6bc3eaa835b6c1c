"""The standard OTEL_* variables, read once for every signal tokenprobe exports.

Traces (proxy/sinks/tracing.py) and metrics (proxy/sinks/otlp.py) share these rules:
a signal's own variable wins over the general one (OTEL_EXPORTER_OTLP_METRICS_PROTOCOL
over OTEL_EXPORTER_OTLP_PROTOCOL, and so on for ENDPOINT, HEADERS and TIMEOUT); the
http/protobuf endpoint of the general variable gets the signal's path (/v1/traces,
/v1/metrics), a signal's own endpoint is used as it is; grpc takes either as it is.
A value that cannot be used raises SettingsError naming the variable.

Nothing here imports the OpenTelemetry SDK at module level: deciding whether a signal
is on must cost nothing when it is off.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from proxy.settings import SettingsError

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource

PROTOCOLS = ("http/protobuf", "grpc")
_DEFAULT_HTTP = "http://localhost:4318"
_DEFAULT_GRPC = "http://localhost:4317"


def otel_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The OTEL_* variables that are set to something, stripped."""
    return {k: v.strip() for k, v in environ.items() if k.startswith("OTEL_") and v.strip()}


def sdk_disabled(env: Mapping[str, str]) -> bool:
    return env.get("OTEL_SDK_DISABLED", "").lower() == "true"


def exporter_names(env: Mapping[str, str], variable: str) -> list[str]:
    """OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER as a list of lower-case names."""
    return [n.strip().lower() for n in env.get(variable, "").split(",") if n.strip()]


def metrics_requested(environ: Mapping[str, str]) -> bool:
    """Whether OTEL_METRICS_EXPORTER names otlp (or console). Prometheus is always on; OTLP
    metrics only when asked for, not merely because a traces endpoint is set."""
    env = otel_env(environ)
    names = exporter_names(env, "OTEL_METRICS_EXPORTER")
    if sdk_disabled(env) or "none" in names:
        return False
    unknown = [n for n in names if n not in ("otlp", "console", "prometheus")]
    if unknown:
        raise SettingsError(
            f"OTEL_METRICS_EXPORTER={unknown[0]!r}: expected otlp, console, prometheus or none"
        )
    return "otlp" in names or "console" in names


@dataclass(frozen=True, slots=True)
class OtlpTarget:
    """Where and how one signal goes: what an OTLP exporter's constructor takes."""

    protocol: str  # http/protobuf or grpc
    endpoint: str
    headers: dict[str, str] | None
    timeout: float  # seconds, per export


def otlp_target(env: Mapping[str, str], signal: str) -> OtlpTarget:
    """The OTLP target of `signal` ("traces" or "metrics")."""
    upper = signal.upper()
    key = f"OTEL_EXPORTER_OTLP_{upper}_PROTOCOL"
    if key not in env:
        key = "OTEL_EXPORTER_OTLP_PROTOCOL"
    protocol = env.get(key, "http/protobuf")
    if protocol not in PROTOCOLS:
        raise SettingsError(f"{key}={protocol!r}: expected http/protobuf or grpc")
    endpoint = env.get(f"OTEL_EXPORTER_OTLP_{upper}_ENDPOINT")
    if endpoint is None and protocol == "http/protobuf":
        base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", _DEFAULT_HTTP)
        endpoint = base.rstrip("/") + f"/v1/{signal}"
    elif endpoint is None:
        endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", _DEFAULT_GRPC)
    timeout = float_value(env, f"OTEL_EXPORTER_OTLP_{upper}_TIMEOUT", None)
    if timeout is None:
        timeout = float_value(env, "OTEL_EXPORTER_OTLP_TIMEOUT", 10.0)
    assert timeout is not None
    return OtlpTarget(protocol, endpoint, headers(env, signal), timeout)


def headers(env: Mapping[str, str], signal: str) -> dict[str, str] | None:
    """OTEL_EXPORTER_OTLP_{SIGNAL}_HEADERS, else OTEL_EXPORTER_OTLP_HEADERS (k=v,k=v)."""
    from opentelemetry.util.re import parse_env_headers

    raw = env.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_HEADERS") or env.get(
        "OTEL_EXPORTER_OTLP_HEADERS"
    )
    return dict(parse_env_headers(raw, liberal=True)) if raw else None


def service_name(env: Mapping[str, str]) -> str:
    if name := env.get("OTEL_SERVICE_NAME"):
        return name
    for item in env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        key, _, value = item.partition("=")
        if key.strip() == "service.name" and value.strip():
            return value.strip()
    return "tokenprobe"


_instance: tuple[int, str] | None = None


def instance_id() -> str:
    """This process's `service.instance.id`: a random UUID, new in each worker process
    (checked by pid, so a forked worker never inherits its parent's)."""
    global _instance
    if _instance is None or _instance[0] != os.getpid():
        _instance = (os.getpid(), str(uuid.uuid4()))
    return _instance[1]


def resource(env: Mapping[str, str]) -> Resource:
    """The resource every signal of this process carries: service.name and
    service.instance.id, so a collector can sum several workers' series."""
    from opentelemetry.sdk.resources import Resource

    return Resource.create(
        {"service.name": service_name(env), "service.instance.id": instance_id()}
    )


def float_value(env: Mapping[str, str], key: str, default: float | None) -> float | None:
    if key not in env:
        return default
    try:
        return float(env[key])
    except ValueError:
        raise SettingsError(f"{key}={env[key]!r}: expected a number") from None


def int_value(env: Mapping[str, str], key: str, default: int) -> int:
    if key not in env:
        return default
    try:
        value = int(env[key])
    except ValueError:
        raise SettingsError(f"{key}={env[key]!r}: expected a whole number") from None
    if value < 1:
        raise SettingsError(f"{key}={value}: must be at least 1")
    return value


def otlp_exporter_kwargs(target: OtlpTarget) -> dict[str, Any]:
    return {"endpoint": target.endpoint, "headers": target.headers, "timeout": target.timeout}
