"""Typed settings from CLI flags and TOKENPROBE_* environment variables, validated at start.

Each setting is declared once, in `SPECS`: its flag, environment variable, type, default
and help. A flag wins over its variable; a bad value fails at start with a message that
names the flag and the variable, never later at the first request.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


class SettingsError(ValueError):
    """A setting is missing or has a bad value. The message names it."""


def _url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("expected an http:// or https:// URL with a host")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise ValueError(f"bad port: {exc}") from None
    return value.rstrip("/").removesuffix("/v1")


def _port(value: str) -> int:
    port = int(value)
    if not 0 <= port <= 65535:
        raise ValueError("must be between 0 and 65535")
    return port


def _seconds(value: str) -> float:
    seconds = float(value)
    if not seconds > 0:  # also refuses nan, which compares false with everything
        raise ValueError("must be a positive number of seconds")
    return seconds


def _optional_seconds(value: str) -> float | None:
    return None if value.lower() in ("", "0", "none", "off") else _seconds(value)


def _positive_int(value: str) -> int:
    n = int(value)
    if n < 1:
        raise ValueError("must be at least 1")
    return n


def _cost(value: str) -> float:
    cost = float(value)
    if not cost >= 0 or cost == float("inf"):  # also refuses nan
        raise ValueError("must be a finite number >= 0 (cost per hour)")
    return cost


def _currency(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be empty, e.g. USD")
    return value.strip()


def _bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def _csv(value: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in value.split(",") if item.strip())


def _choice(*options: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if value not in options:
            raise ValueError(f"expected one of {', '.join(options)}")
        return value

    return parse


@dataclass(frozen=True)
class Spec:
    name: str  # attribute of Settings; flag is --name-with-dashes, env TOKENPROBE_NAME
    parse: Callable[[str], Any]
    default: Any
    help: str
    is_flag: bool = False  # a boolean switch: --name / --no-name

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "TOKENPROBE_" + self.name.upper()


SPECS: tuple[Spec, ...] = (
    Spec(
        "upstream",
        _url,
        None,
        "Base URL of the OpenAI-compatible backend, e.g. http://vllm:8000 (required).",
    ),
    Spec("host", str, "127.0.0.1", "Address to listen on (0.0.0.0 for all interfaces)."),
    Spec("port", _port, 4000, "Port to listen on."),
    Spec("connect_timeout", _seconds, 10.0, "Seconds to open a connection to the upstream."),
    Spec(
        "first_byte_timeout",
        _seconds,
        600.0,
        "Seconds from sending a request upstream to its response headers (covers queueing and prefill).",
    ),
    Spec(
        "idle_timeout",
        _seconds,
        300.0,
        "Seconds allowed between two chunks of an upstream response.",
    ),
    Spec("body_timeout", _seconds, 60.0, "Seconds a client may take to send its request body."),
    Spec(
        "max_body_bytes",
        _positive_int,
        32 * 1024 * 1024,
        "Largest request body accepted (413 above it).",
    ),
    Spec(
        "max_header_bytes",
        _positive_int,
        64 * 1024,
        "Largest total size of request headers accepted (431 above it; counted as they "
        "arrive, with 8 KiB more for the request line and framing).",
    ),
    Spec(
        "max_headers",
        _positive_int,
        100,
        "Most request headers accepted (431 above it, counted as they arrive).",
    ),
    Spec(
        "header_timeout",
        _optional_seconds,
        10.0,
        "Seconds a client gets to send a complete request head, from the connection opening "
        "or the previous response ending (408, or a close when nothing came; 0 disables).",
    ),
    Spec(
        "max_event_bytes",
        _positive_int,
        4 * 1024 * 1024,
        "Largest SSE event the proxy buffers to measure or strip; a stream with a larger one "
        "is relayed unmeasured (counted in tokenprobe_measurement_failures_total).",
    ),
    Spec(
        "tokenizer",
        str,
        None,
        "Local tokenizer directory (transformers.AutoTokenizer), used when the backend sends no usage.",
    ),
    Spec(
        "inject_usage",
        _bool,
        True,
        "Ask the upstream for usage on streams whose client did not, and remove that extra chunk from the client's stream.",
        is_flag=True,
    ),
    Spec(
        "model_allowlist",
        _csv,
        (),
        "Comma-separated model names allowed as metric labels, besides those the upstream lists at /v1/models.",
    ),
    Spec(
        "models_refresh",
        _optional_seconds,
        60.0,
        "Seconds between refreshes of the upstream's /v1/models (0 disables).",
    ),
    Spec(
        "upstream_transport",
        _choice("aiohttp", "httpx"),
        "aiohttp",
        "httpx transport for upstream requests: aiohttp (httpx-aiohttp, faster) or httpx (its default).",
    ),
    Spec(
        "access_log",
        _choice("json", "text", "off"),
        "json",
        "Per-request log line on stdout: json, text or off.",
    ),
    Spec(
        "log_salt",
        str,
        None,
        "Salt keying the access log's prefix hashes (never logged; default: random per "
        "process). Set one value for every worker and replica whose logs are replayed together.",
    ),
    Spec(
        "trace_content",
        _bool,
        False,
        "Put prompt and completion text in trace spans.",
        is_flag=True,
    ),
    Spec(
        "metrics_port",
        _port,
        None,
        "Serve /metrics on this separate port instead of the proxy port.",
    ),
    Spec("metrics_host", str, None, "Address for --metrics-port (default: the same as --host)."),
    Spec("metrics_token", str, None, "Require 'Authorization: Bearer <token>' on /metrics."),
    Spec(
        "key_label",
        _choice("none", "hash"),
        "none",
        "Attribute requests to API keys by a short salted hash (hash) or not at all (none).",
    ),
    Spec("key_salt", str, None, "Salt for --key-label hash (default: random per process)."),
    Spec(
        "secret_headers",
        _csv,
        (),
        "Extra request headers to treat as secret (never logged or traced).",
    ),
    Spec("prices", str, None, "Price table (YAML or JSON) for tokenprobe_cost_total."),
    Spec(
        "cost_per_hour",
        _cost,
        None,
        "The deployment's cost per hour (GPUs behind the backend), exported as "
        "tokenprobe_deployment_cost_per_hour for cost per million tokens at the observed throughput.",
    ),
    Spec("currency", _currency, "USD", "Currency of --cost-per-hour."),
    Spec("workers", _positive_int, 1, "Worker processes; /metrics aggregates them all."),
    Spec("drain_timeout", _seconds, 30.0, "On SIGTERM, seconds in-flight requests get to finish."),
    Spec(
        "log_level",
        _choice("debug", "info", "warning", "error"),
        "info",
        "Log level for the proxy's own messages.",
    ),
)


@dataclass(frozen=True)
class Settings:
    upstream: str | None = None
    host: str = "127.0.0.1"
    port: int = 4000
    connect_timeout: float = 10.0
    first_byte_timeout: float = 600.0
    idle_timeout: float = 300.0
    body_timeout: float = 60.0
    max_body_bytes: int = 32 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    header_timeout: float | None = 10.0
    max_event_bytes: int = 4 * 1024 * 1024
    tokenizer: str | None = None
    inject_usage: bool = True
    model_allowlist: tuple[str, ...] = ()
    models_refresh: float | None = 60.0
    upstream_transport: str = "aiohttp"
    access_log: str = "json"
    log_salt: str | None = None
    trace_content: bool = False
    metrics_port: int | None = None
    metrics_host: str | None = None
    metrics_token: str | None = None
    key_label: str = "none"
    key_salt: str | None = None
    secret_headers: tuple[str, ...] = ()
    prices: str | None = None
    cost_per_hour: float | None = None
    currency: str = "USD"
    workers: int = 1
    drain_timeout: float = 30.0
    log_level: str = "info"

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting; defaults stay None so `resolve` can tell 'not given'."""
    for spec in SPECS:
        help_text = f"{spec.help} [env {spec.env}; default {spec.default!r}]"
        if spec.is_flag:
            parser.add_argument(
                spec.flag,
                dest=spec.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        else:
            parser.add_argument(
                spec.flag, dest=spec.name, default=None, metavar=spec.name.upper(), help=help_text
            )


def resolve(args: argparse.Namespace | Mapping[str, Any], environ: Mapping[str, str]) -> Settings:
    """Flags first, then TOKENPROBE_* variables, then defaults; every value parsed here."""
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    values: dict[str, Any] = {}
    for spec in SPECS:
        raw = given.get(spec.name)
        source = spec.flag
        if raw is None and spec.env in environ:
            raw, source = environ[spec.env], spec.env
        if raw is None:
            continue
        if isinstance(raw, bool) or not isinstance(raw, str):
            values[spec.name] = raw
            continue
        try:
            values[spec.name] = spec.parse(raw)
        except ValueError as exc:
            raise SettingsError(f"{source}={raw!r}: {exc}") from None
    return Settings(**values)


def require_upstream(settings: Settings) -> str:
    if not settings.upstream:
        raise SettingsError(
            "no upstream: set --upstream http://HOST:PORT or TOKENPROBE_UPSTREAM "
            "(the OpenAI-compatible backend, e.g. vLLM)"
        )
    return settings.upstream


def parse(argv: Sequence[str], environ: Mapping[str, str]) -> Settings:
    parser = argparse.ArgumentParser(prog="tokenprobe serve")
    add_arguments(parser)
    return resolve(parser.parse_args(list(argv)), environ)
