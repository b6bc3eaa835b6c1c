"""Typed settings from CLI flags and TOKENPROBE_* environment variables, validated at start.

Each setting is declared once, in `SPECS`: its flag, environment variable, type, default
and help. A flag wins over its variable; a bad value fails at start with a message that
names the flag and the variable, never later at the first request.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import SplitResult, urlsplit, urlunsplit

from proxy.core import extras
from proxy.core.datafile import parse_data_file
from proxy.core.paths import root_path as _root_path
from proxy.core.pricing import load_prices
from proxy.core.secrets import SECRET_HEADERS, is_secret_header, masked_url
from proxy.core.slo import NAMES as SLO_NAMES
from proxy.core.slo import Policy, SloError, format_slo, parse_slo, parse_slo_file
from proxy.core.upstream_url import UpstreamURL

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

GroupT = TypeVar("GroupT", bound="DataclassInstance")


class SettingsError(ValueError):
    """A setting is missing or has a bad value. The message names it."""


def http_url(value: str) -> SplitResult:
    """`value` split, if it is an http:// or https:// URL with a host and a port that reads:
    else ValueError saying which (--upstream, the OTLP endpoints). urllib's words on a bad
    port quote what follows the last `:`, which is a password's end when it holds `/ ? #`
    (`http://user:pa/ss@host`): with an `@` anywhere, they are left out."""
    parts = urlsplit(value)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ValueError("expected an http:// or https:// URL with a host")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise ValueError("bad port" if "@" in value else f"bad port: {exc}") from None
    return parts


def _url(value: str) -> str:
    """An upstream's URL as every part of the proxy reads it: the scheme in lower case
    (`HTTPS://` is TLS everywhere), no trailing `/` nor `/v1` on its path. Credentials in
    it would be shown (/readyz, logs) and sent by some clients only, a query or fragment
    glued to every control-plane URL: both are refused."""
    parts = http_url(value)
    scheme = parts.scheme.lower()
    if parts.username is not None or parts.password is not None:
        raise ValueError(
            "no credentials in the URL (user:password@): the client's own Authorization "
            "header goes upstream"
        )
    if parts.query or parts.fragment:
        raise ValueError("an upstream's URL takes no query (?...) or fragment (#...)")
    path = parts.path.rstrip("/").removesuffix("/v1")
    return urlunsplit((scheme, parts.netloc, path, "", ""))


def _token(value: str) -> str:
    """A bearer token, without the whitespace around it (a Secret made from a file ends in
    a newline; Prometheus sends its credentials trimmed)."""
    token = value.strip()
    if not token:
        raise ValueError("empty: an `Authorization: Bearer` with no token would match it")
    return token


def _port(value: str) -> int:
    port = int(value)
    if not 0 <= port <= 65535:
        raise ValueError("must be between 0 and 65535")
    return port


def _socket_path(value: str) -> str:
    """A Unix domain socket's path: one that fits `sun_path` (108 bytes with its NUL on
    Linux), or the bind or connect fails later with no flag named."""
    if not value:
        raise ValueError("expected the path of a Unix domain socket")
    if len(os.fsencode(value)) > 107:
        raise ValueError("a Unix socket's path is at most 107 bytes: choose a shorter one")
    return value


def _cert_reqs(value: str) -> int:
    """ssl.CERT_NONE, CERT_OPTIONAL or CERT_REQUIRED by number, as vLLM's --ssl-cert-reqs."""
    if value not in ("0", "1", "2"):
        raise ValueError("expected 0 (no client certificate), 1 (optional) or 2 (required)")
    return int(value)


def _seconds(value: str) -> float:
    seconds = float(value)
    if not seconds > 0:  # also refuses nan, which compares false with everything
        raise ValueError("must be a positive number of seconds")
    return seconds


def _optional_seconds(value: str) -> float | None:
    return None if value.lower() in ("", "0", "none", "off") else _seconds(value)


def positive_int(value: str) -> int:
    n = int(value)
    if n < 1:
        raise ValueError("must be at least 1")
    return n


def _cost(value: str) -> float:
    cost = float(value)
    if not cost >= 0 or cost == float("inf"):  # also refuses nan
        raise ValueError("must be a finite number >= 0 (cost per hour)")
    return cost


def _host(value: str) -> str:
    # uvicorn binds "" to every interface, which no one asks for by saying nothing
    if not value.strip():
        raise ValueError(
            "must not be empty: 127.0.0.1 for this machine, 0.0.0.0 for every interface"
        )
    host = value.strip()
    try:
        ipaddress.ip_address(host)
    except ValueError:  # a name: uvicorn's bind said only "Name or service not known", exit 3
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except (OSError, UnicodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ValueError(f"cannot be resolved to an address to listen on ({reason})") from None
    return host


def _prices(value: str) -> str:
    """A price table path, read once here so that a bad table fails at start, naming itself
    (as --slo-file): its workers would each fail to start, and be started again."""
    try:
        load_prices(value)
    except OSError as exc:
        raise ValueError(f"{value}: cannot read the price table: {exc.strerror}") from None
    return value


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


# Label names the metrics already use (and Prometheus's own), which a --label-header
# label may not take.
_TAKEN_LABELS = frozenset(
    {
        *("model", "endpoint", "code", "finish_reason", "error_type", "source", "kind", "key"),
        *("prompt_class", "cache_class", "route", "stage", "reason", "currency", "le"),
        *("quantile", "result"),
    }
)
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def label_headers(value: str) -> tuple[str, ...]:
    """`x-team=team,x-app=app` -> ("x-team=team", "x-app=app"), each checked: a header
    name, a label name no metric uses yet, and never a header that carries credentials."""
    pairs: list[str] = []
    headers: set[str] = set()
    labels: set[str] = set()
    for item in _csv(value):
        header, sep, label = (part.strip() for part in item.partition("="))
        header = header.lower()
        if not sep or not _HEADER_NAME.match(header) or not _LABEL_NAME.match(label):
            raise ValueError(f"{item!r}: expected HEADER=LABEL, e.g. x-team=team")
        if is_secret_header(header):
            raise ValueError(
                f"{header!r} carries credentials: a secret header never becomes a label "
                "(its values never leave the proxy); pick a header without them"
            )
        if label in _TAKEN_LABELS or label.startswith("__") or label in labels:
            raise ValueError(f"label {label!r} is taken; pick another name")
        if header in headers:
            raise ValueError(f"header {header!r} is named twice")
        headers.add(header)
        labels.add(label)
        pairs.append(f"{header}={label}")
    return tuple(pairs)


def _slo(value: str) -> str:
    """--slo checked and written back in one canonical form (workers get it as text)."""
    return format_slo(parse_slo(value, ""))  # SloError is a ValueError


def _slo_file(value: str) -> str:
    load_slo_file(value)  # read once here so a bad file fails at start, naming itself
    return value


def load_slo_file(path: str) -> Policy:
    """An SLO file (proxy/core/slo.py's `parse_slo_file`); SloError naming it."""
    try:
        data = parse_data_file(Path(path).read_text(encoding="utf-8"), path)
    except (OSError, ValueError) as exc:
        raise SloError(f"{path}: cannot read the SLO file: {exc}") from None
    return parse_slo_file(data, path)


def conversation_header(value: str) -> str:
    """A header name whose value names a conversation; never one that carries credentials
    (its value is only hashed, but an API key is no conversation)."""
    header = value.strip().lower()
    if not _HEADER_NAME.match(header):
        raise ValueError("expected a header name, e.g. x-session-id")
    if header.encode() in SECRET_HEADERS:
        raise ValueError(f"{header!r} carries credentials; pick the header naming the session")
    return header


def _ratio(value: str) -> float:
    ratio = float(value)
    if not 0.0 <= ratio <= 1.0:  # also refuses nan
        raise ValueError("must be a number between 0 and 1")
    return ratio


def _choice(*options: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if value not in options:
            raise ValueError(f"expected one of {', '.join(options)}")
        return value

    return parse


@dataclass(frozen=True)
class Spec:
    """How one Settings field is given: derived from its declaration, never written by hand."""

    name: str  # attribute of Settings; flag is --name-with-dashes, env TOKENPROBE_NAME
    parse: Callable[[str], Any]
    default: Any  # REQUIRED when it has none
    help: str  # the --help text and the README table's "meaning"
    shown: str  # the README table's "default" cell
    is_flag: bool = False  # a boolean switch: --name / --no-name
    repeat: bool = False  # a list: the flag may be given several times, values joined by ","

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "TOKENPROBE_" + self.name.upper()

    @property
    def flags(self) -> str:
        """The flag as the README writes it: `--x`, or `--x` / `--no-x` for a switch."""
        no = f" / `--no-{self.flag[2:]}`" if self.is_flag else ""
        return f"`{self.flag}`{no}"


#: The default of a setting that must be given (only the upstream).
REQUIRED: Any = object()


def setting(
    parse: Callable[[str], Any],
    default: Any,
    help: str,
    *,
    shown: str | None = None,
    switch: bool = False,
    repeat: bool = False,
) -> Any:
    """Declare one setting as a Settings field: how its text is parsed, its default, its
    help (also the README's), how the README shows the default when not as written, and
    whether it is a --x / --no-x switch or a flag that may be repeated."""
    meta = {"parse": parse, "help": help, "shown": shown, "switch": switch, "repeat": repeat}
    if default is REQUIRED:
        return field(metadata=meta)
    return field(default=default, metadata=meta)


def _shown(default: Any) -> str:
    if default is REQUIRED:
        return "(required)"
    if default is None:
        return "(unset)"
    if default == ():
        return "(none)"
    if isinstance(default, bool):
        return "true" if default else "false"
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    return str(default)


@dataclass(frozen=True)
class Settings:
    """Every setting of `tokenprobe serve`, each declared once, here: its type, default,
    parser, help and docs row. The flag, the TOKENPROBE_* variable, argparse, the settings
    reference (`settings_table`: docs/generate.py writes it, tests/test_docs.py keeps it
    equal) all come from these fields, via `SPECS`. Worker processes are handed the
    resolved Settings whole (proxy/server/serve.py `WorkerApp`)."""

    upstream: str = setting(
        _url,
        REQUIRED,
        "Base URL of the OpenAI-compatible backend, e.g. http://vllm:8000 (a trailing `/v1` is ignored; a base path is kept; credentials, a query or a fragment in it are refused).",
    )
    upstream_uds: str | None = setting(
        _socket_path,
        None,
        "Connect to the upstream through this Unix domain socket (a vLLM started with --uds, as curl's --unix-socket); --upstream still gives the scheme, the Host header and the base path, e.g. `--upstream http://localhost --upstream-uds /run/vllm.sock`.",
    )
    root_path: str | None = setting(
        _root_path,
        None,
        "The root path the backend serves its routes under as well as at the root, as vLLM's --root-path (give the same value): a request under it, e.g. `/tenant-a/v1/chat/completions`, is measured as the path after it (`/v1/chat/completions`) and forwarded unchanged; keep it out of --upstream, whose base path goes in front of every request. The proxy's own routes (`/metrics`, `/healthz`...) stay at the root. See docs/proxying.md.",
    )
    enable_ssl_refresh: bool = setting(
        _bool,
        False,
        "Reload the TLS files (--ssl-certfile, --ssl-keyfile, --ssl-ca-certs, and the --upstream-* ones) when they change on disk, as vLLM's --enable-ssl-refresh: a rotated certificate reaches new connections without a restart; checked every second.",
        switch=True,
    )
    upstream_ca_certs: str | None = setting(
        str,
        None,
        "CA bundle an https:// upstream's certificate is checked against (a vLLM certified by your own CA), in place of the system's bundle; every client the proxy has uses it. Unset: the system's bundle, or SSL_CERT_FILE.",
        shown="the system's",
    )
    upstream_ssl_certfile: str | None = setting(
        str,
        None,
        "PEM client certificate the proxy presents to an https:// upstream that asks for one (a vLLM with --ssl-cert-reqs 2); with --upstream-ssl-keyfile.",
    )
    upstream_ssl_keyfile: str | None = setting(
        str, None, "PEM private key of --upstream-ssl-certfile (its path only is ever shown)."
    )
    host: str = setting(_host, "127.0.0.1", "Address to listen on (0.0.0.0 for all interfaces).")
    port: int = setting(_port, 4000, "Port to listen on.")
    uds: str | None = setting(
        _socket_path,
        None,
        "Listen on this Unix domain socket instead of --host and --port, as vLLM's --uds: made as vLLM makes its own, with the mode the process's umask gives (a socket file left at the path is replaced). `/metrics` is on it too, unless --metrics-port.",
    )
    ssl_certfile: str | None = setting(
        str,
        None,
        "PEM certificate (chain) to serve HTTPS and WSS with, as vLLM's --ssl-certfile; with --ssl-keyfile. Unset: plain HTTP.",
    )
    ssl_keyfile: str | None = setting(
        str, None, "PEM private key of --ssl-certfile (its path only is ever shown)."
    )
    ssl_ca_certs: str | None = setting(
        str,
        None,
        "CA bundle that clients' certificates are checked against (mutual TLS), as vLLM's --ssl-ca-certs; with --ssl-cert-reqs.",
    )
    ssl_cert_reqs: int = setting(
        _cert_reqs,
        0,
        "Whether clients must present a certificate, as vLLM's --ssl-cert-reqs: 0 no, 1 checked when given, 2 required (needs --ssl-ca-certs).",
    )
    ssl_ciphers: str | None = setting(
        str,
        None,
        "OpenSSL cipher list for TLS 1.2 and below, as vLLM's --ssl-ciphers (unset: uvicorn's).",
        shown="uvicorn's",
    )
    connect_timeout: float = setting(
        _seconds, 10.0, "Seconds to open a connection to the upstream."
    )
    first_byte_timeout: float = setting(
        _seconds,
        600.0,
        "Seconds from sending a request upstream to its response headers (covers queueing and prefill).",
    )
    idle_timeout: float = setting(
        _seconds,
        300.0,
        "Seconds allowed between two chunks of an upstream response, and for a client that takes "
        "no bytes of a response it holds up (cut between one and two of these, as client_cancelled, "
        "the upstream closed). There is no total-time limit.",
    )
    body_timeout: float = setting(
        _seconds, 60.0, "Seconds a client may take to send its request body (slow-body protection)."
    )
    max_body_bytes: int = setting(
        positive_int, 32 * 1024 * 1024, "Largest request body accepted (413 above it)."
    )
    max_header_bytes: int = setting(
        positive_int,
        64 * 1024,
        "Largest total size of the request headers' names and values: over it, 431, and the "
        "connection stays open; a head larger than this plus 8 KiB (request line and framing "
        "included) is refused with 431 and a close as it arrives, before it is all read.",
    )
    max_headers: int = setting(
        positive_int,
        100,
        "Most request headers, counted while they arrive (431 and close above it).",
    )
    header_timeout: float | None = setting(
        _optional_seconds,
        10.0,
        "Seconds a client gets to send a whole request head, from connecting, or on a kept-alive connection from the head's first byte (408; a new connection that sent nothing is closed without one; 0 disables).",
    )
    keep_alive_timeout: float = setting(
        _seconds,
        5.0,
        "Seconds an idle client connection stays open between requests (uvicorn's and vLLM's default: 5). Behind a load balancer that keeps connections to the proxy, set it above the balancer's idle timeout (AWS ALB: 60 s), as vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE, or requests it sends on a connection the proxy just closed fail with 502.",
    )
    max_event_bytes: int = setting(
        positive_int,
        4 * 1024 * 1024,
        'Largest SSE event buffered to measure or strip; a larger event is relayed all the same, and that stream goes unmeasured (`tokenprobe_measurement_failures_total{stage="event_too_large"}`). Also the largest WebSocket message read on a measured path (once inflated): a larger one is relayed unread and the session is measured on without it (`stage="ws_message_too_large"`).',
    )
    ws_idle_timeout: float = setting(
        _seconds,
        300.0,
        "Seconds a WebSocket tunnel may carry no byte either way before the proxy closes it, "
        "counted from the upstream's 101 (the wait for an answer is `--first-byte-timeout`'s; "
        "a refusal's body, an ordinary response's, is read under `--idle-timeout`).",
    )
    ws_max_tunnels: int = setting(
        positive_int,
        4096,
        "Most WebSocket tunnels open at once per worker, a handshake waiting for the "
        "upstream's answer included; one past it is answered `503` `too_many_websockets` "
        "with `Retry-After: 1` before anything goes upstream. The default is four times the "
        "most sequences vLLM runs at once by default (1024 on an H100), so it never sheds a "
        "session the backend would take; it bounds what a client opening tunnels can hold "
        "(8,192 descriptors, some 20 KB each idle).",
    )
    tokenizer: str | None = setting(
        str,
        None,
        "Local tokenizer directory for counting when the backend sends no usage (and the prompt of abandoned streams). Needs the tokenizer extra (`pip install '.[tokenizer]'` in tokenprobe's clone): without transformers the proxy refuses to start.",
    )
    inject_usage: bool = setting(
        _bool,
        True,
        "Ask upstream for usage on streams whose client did not, and remove that chunk from the client's stream.",
        switch=True,
    )
    model_allowlist: tuple[str, ...] = setting(
        _csv,
        (),
        "Comma-separated model names allowed as labels, besides those the upstream lists. Set it when the upstream's `/v1/models` needs a key.",
    )
    models_refresh: float | None = setting(
        _optional_seconds,
        60.0,
        "Seconds between refreshes of the upstream's `/v1/models` (0 disables).",
    )
    upstream_transport: str = setting(
        _choice("aiohttp", "httpx"),
        "aiohttp",
        "The ASGI relay's httpx transport (`--relay asgi`): `aiohttp` (httpx-aiohttp) or `httpx` (its own); the wire has its own upstream pool. See Performance.",
    )
    access_log: str = setting(
        _choice("json", "text", "off"), "json", "One line per request on stdout: json, text or off."
    )
    log_salt: str | None = setting(
        str,
        None,
        "Salt keying the access log's prefix hashes (never logged). Unset, one is drawn at "
        "start for all `--workers`, and another at each start; set one value for every "
        "replica, and across restarts, whose logs are replayed or compared together.",
        shown="random",
    )
    trace_content: bool = setting(_bool, False, "Put the prompt in trace spans.", switch=True)
    metrics_port: int | None = setting(
        _port,
        None,
        "Serve `/metrics` and the live view `/ui` on this separate port, in plain HTTP (and "
        "not on the proxy port, where those paths then go to the backend).",
    )
    metrics_host: str | None = setting(
        _host, None, "Address for `--metrics-port`.", shown="`--host`"
    )
    metrics_token: str | None = setting(
        _token,
        None,
        "Require `Authorization: Bearer <token>` on `/metrics`; `/healthz`, `/readyz` and "
        "the `/ui` page (which asks for the token) stay open.",
    )
    key_label: str = setting(
        _choice("none", "hash"),
        "none",
        "`hash`: attribute requests to API keys by a short salted hash; a key gets a label "
        "of its own (100 at most) only once the backend accepted it (refused keys are "
        "`rejected`).",
    )
    key_salt: str | None = setting(
        str,
        None,
        "Salt for `--key-label hash`; unset, one is drawn at start for all `--workers`; set "
        "it to keep labels stable across restarts and replicas.",
        shown="random",
    )
    secret_headers: tuple[str, ...] = setting(
        _csv,
        (),
        "Extra request headers whose values are redacted wherever an upstream echoes them (`Authorization`, `api-key`, `x-api-key`, cookies, and names with auth, token, secret, api-key... in them always are).",
    )
    label_header: tuple[str, ...] = setting(
        label_headers,
        (),
        "`HEADER=LABEL` (repeatable, or comma-separated): the header's value becomes label `LABEL` on the request and token counters, latency histograms, spans, OTLP metrics and the access log, bounded by `--label-values`; secret headers are refused.",
        repeat=True,
    )
    label_values: int = setting(
        positive_int,
        50,
        "Distinct values each `--label-header` label may take (all `--workers` together, restarted ones too); later ones share `other`.",
    )
    prices: str | None = setting(
        _prices, None, "Price table (YAML or JSON) for `tokenprobe_cost_total`."
    )
    cost_per_hour: float | None = setting(
        _cost,
        None,
        "The deployment's cost per hour, exported as `tokenprobe_deployment_cost_per_hour` for cost per million tokens at the observed throughput.",
    )
    currency: str = setting(_currency, "USD", "Currency of `--cost-per-hour`.")
    relay: str = setting(
        _choice("wire", "asgi"),
        "wire",
        "The data path: `wire` (protocol-level, the fast default) or `asgi` (the ASGI relay through httpx, what `proxy.asgi:app` runs under any ASGI server). See Data paths in docs/architecture.md.",
    )
    workers: int = setting(
        positive_int,
        1,
        "Worker processes sharing the port; `/metrics` sums them all. Conversations, and "
        "background Responses' tokens (counted when retrieved through the same worker), "
        "are tracked per worker (see Deployment).",
    )
    drain_timeout: float = setting(
        _seconds,
        30.0,
        "How long in-flight streams may finish once a signal stops the proxy accepting; "
        "streams still running then are cut. SIGTERM and SIGINT (Ctrl-C) drain, then exit 0. "
        "SIGHUP drains a single process, then ends it by SIGHUP; with `--workers` it replaces "
        "the workers one by one, each drained.",
    )
    log_level: str = setting(
        _choice("debug", "info", "warning", "error"),
        "info",
        "Level of the proxy's own messages (stderr).",
    )
    # Conversations (proxy/core/conversations.py, docs/conversations.md).
    conversation_header: str | None = setting(
        conversation_header,
        None,
        "Request header naming a conversation (e.g. `x-session-id`): requests with the same value are one conversation. Its value is hashed with `--log-salt`, never kept or exported in clear; a value over 256 bytes or not printable ASCII is not used (`tokenprobe_conversation_header_refused_total`).",
    )
    conversation_idle: float = setting(
        _seconds,
        300.0,
        "Seconds without a request after which a conversation is over and its turns and duration are observed.",
    )
    conversation_table: int = setting(
        positive_int,
        10_000,
        "Most conversations the proxy remembers per process (under 900 bytes each); when full the one touched longest ago goes (`tokenprobe_conversation_evictions_total`).",
    )
    continuation_cache_miss_ratio: float = setting(
        _ratio,
        0.5,
        "A continuation whose cached prompt tokens cover less than this share of the prompt it repeats counts in `tokenprobe_continuation_cache_misses_total`.",
    )

    # -- service-level objectives (proxy/core/slo.py, proxy/sinks/slo.py) --
    slo: str = setting(
        _slo,
        "",
        "SLO targets in seconds, as `tokenprobe bench --slo`: e.g. `ttft=2,tpot=0.025` (names: "
        + ", ".join(SLO_NAMES)
        + "). Counts `tokenprobe_slo_requests_total{result}` and `tokenprobe_goodput_tokens_total`. See docs/slo.md.",
        shown="(none)",
    )
    slo_file: str | None = setting(
        _slo_file,
        None,
        "Per-model SLO targets (YAML or JSON: `default:` and `models: {NAME: {ttft: 4}}`); a model not in it gets `--slo` or the file's default. Read at start: a bad file refuses to start.",
    )

    def __post_init__(self) -> None:
        validate(self)  # built in code or from the command line: the same checks

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


def _spec(f: dataclasses.Field[Any]) -> Spec:
    meta = f.metadata
    default = REQUIRED if f.default is dataclasses.MISSING else f.default
    return Spec(
        f.name,
        meta["parse"],
        default,
        meta["help"],
        meta["shown"] or _shown(default),
        is_flag=meta["switch"],
        repeat=meta["repeat"],
    )


SPECS: tuple[Spec, ...] = tuple(_spec(f) for f in dataclasses.fields(Settings))


#: Every setting's name: a settings group's field named like one takes its value (`group`).
NAMES = frozenset(spec.name for spec in SPECS)


def group(cls: type[GroupT], settings: Settings, **derived: Any) -> GroupT:
    """A settings group (the values one part of the proxy reads at startup, as a
    dataclass), built the one way: a field named like a setting takes that setting's
    value, `derived` gives the fields computed from settings, and a field that is
    neither keeps its default. A field with no value and no default fails here, at
    startup; tests/server/test_settings_groups.py checks every group."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name in derived:
            values[f.name] = derived.pop(f.name)
        elif f.name in NAMES:
            values[f.name] = getattr(settings, f.name)
    if derived:
        raise TypeError(f"{cls.__name__} has no fields {sorted(derived)}")
    return cls(**values)


def settings_table() -> str:
    """The settings table of docs/reference/settings.md, rendered from the declarations."""
    rows = ["| flag | variable | default | meaning |", "|---|---|---|---|"]
    rows += [f"| {s.flags} | `{s.env}` | {s.shown} | {s.help} |" for s in SPECS]
    return "\n".join(rows) + "\n"


def parse_value(source: str, raw: str, parse: Callable[[str], Any]) -> Any:
    """One value parsed, or SettingsError naming where it came from (a flag or a variable).
    The OTEL_* variables (proxy/sinks/otel_env.py) are read through this too. The refusal
    lands in logs, so the value is shown as a URL is (`masked_url`: its user info and
    credential parameters masked), whatever the setting: only a URL holds those."""
    try:
        return parse(raw)
    except ValueError as exc:
        raise SettingsError(f"{source}={masked_url(raw)!r}: {exc}") from None


def number(value: str) -> float:
    """A finite number."""
    parsed = float(value)
    if parsed != parsed or parsed in (float("inf"), float("-inf")):
        raise ValueError("expected a finite number")
    return parsed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting; defaults stay None so `resolve` can tell 'not given'."""
    for spec in SPECS:
        help_text = f"{spec.help} [env {spec.env}; default {spec.shown}]"
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
                spec.flag,
                dest=spec.name,
                default=None,
                metavar=spec.name.upper(),
                help=help_text,
                action="append" if spec.repeat else "store",
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
        if isinstance(raw, list):  # a repeated flag
            raw = ",".join(raw)
        if isinstance(raw, bool) or not isinstance(raw, str):
            values[spec.name] = raw
            continue
        values[spec.name] = parse_value(source, raw, spec.parse)
    if "upstream" not in values:
        raise SettingsError(
            "no upstream: set --upstream http://HOST:PORT or TOKENPROBE_UPSTREAM "
            "(the OpenAI-compatible backend, e.g. vLLM)"
        )
    return Settings(**values)  # Settings.__post_init__ runs `validate`


def text(value: Any) -> str:
    """A value written back as the text its flag takes (a list joined by ","): what
    `validate` parses again."""
    return ",".join(value) if isinstance(value, tuple) else str(value)


def validate(settings: Settings) -> None:
    """Every check of the settings, in one place: each value passes its own parser (the
    ranges and formats of the flag), then the checks across settings and of the install.
    `Settings.__post_init__` calls it, so `Settings(...)` built in code, `resolve` (the
    command line and the variables) and every `replace` are refused alike, with the
    message naming the flag."""
    for spec in SPECS:
        value = getattr(settings, spec.name)
        if value is not None:
            parsed = parse_value(spec.flag, text(value), spec.parse)
            if parsed != value or type(parsed) is not type(value):
                # as the flag reads it: `upstream` ".../v1" without its /v1, a timeout of 0
                # off, a port "4000" the number (the command line gives parsed values)
                object.__setattr__(settings, spec.name, parsed)
    _check_label_headers(settings)
    _check_tls(settings)
    _check_uds(settings)
    _check_workers(settings)
    _check_metrics_listener(settings)
    require_tokenizer_support(settings)


def _check_tls(settings: Settings) -> None:
    """The listener's TLS files and the upstream's, each pair both or neither and loading,
    and nothing given that would do nothing: refused at start with the flag's name, not a
    traceback from the server once it binds or from the first request upstream."""
    import ssl

    _check_pair(settings.ssl_certfile, settings.ssl_keyfile, "--ssl-certfile", "--ssl-keyfile")
    listening = settings.ssl_certfile is not None
    for flag, given in (
        ("--ssl-ca-certs", settings.ssl_ca_certs is not None),
        ("--ssl-cert-reqs", settings.ssl_cert_reqs != 0),
        ("--ssl-ciphers", settings.ssl_ciphers is not None),
    ):
        if given and not listening:
            raise SettingsError(f"{flag} needs --ssl-certfile: it sets the proxy's own HTTPS")
    if settings.ssl_cert_reqs and settings.ssl_ca_certs is None:
        raise SettingsError(
            f"--ssl-cert-reqs {settings.ssl_cert_reqs} needs --ssl-ca-certs: clients' "
            "certificates are checked against that bundle, and against nothing without it"
        )
    _check_bundle(settings.ssl_ca_certs, "--ssl-ca-certs")
    if settings.ssl_ciphers is not None:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).set_ciphers(settings.ssl_ciphers)
        except ssl.SSLError:
            raise SettingsError(
                f"--ssl-ciphers {settings.ssl_ciphers!r}: OpenSSL knows none of these ciphers"
            ) from None
    _check_pair(
        settings.upstream_ssl_certfile,
        settings.upstream_ssl_keyfile,
        "--upstream-ssl-certfile",
        "--upstream-ssl-keyfile",
    )
    _check_bundle(settings.upstream_ca_certs, "--upstream-ca-certs")
    files = (settings.ssl_certfile, settings.upstream_ssl_certfile, settings.upstream_ca_certs)
    if settings.enable_ssl_refresh and all(f is None for f in files):
        raise SettingsError(
            "--enable-ssl-refresh needs --ssl-certfile, --upstream-ssl-certfile or "
            "--upstream-ca-certs: there is no TLS file to reload"
        )
    if not UpstreamURL.parse(settings.upstream).tls:  # https, in any case
        for flag, value in (
            ("--upstream-ca-certs", settings.upstream_ca_certs),
            ("--upstream-ssl-certfile", settings.upstream_ssl_certfile),
        ):
            if value is not None:
                raise SettingsError(f"{flag} needs an https:// --upstream: it is for its TLS")


def _check_workers(settings: Settings) -> None:
    """Each worker process builds the app, and so would each bind --metrics-port: the
    second one fails and the server never starts (with uvicorn's exit status 0)."""
    if settings.workers > 1 and settings.metrics_port is not None:
        raise SettingsError(
            "--metrics-port takes one process: with --workers, scrape /metrics on the "
            "proxy's port (any worker answers for all; --metrics-token guards it)"
        )


def _check_metrics_listener(settings: Settings) -> None:
    """--metrics-port on an address of its own: the proxy's port on the same host would
    fail to bind after start with an error naming no flag; --metrics-host alone does
    nothing."""
    if settings.metrics_port is None:
        if settings.metrics_host is not None:
            raise SettingsError("--metrics-host needs --metrics-port: it is that port's address")
        return
    host = settings.metrics_host if settings.metrics_host is not None else settings.host
    anywhere = ("0.0.0.0", "::", "")
    if (
        settings.uds is None
        and settings.metrics_port == settings.port != 0
        and (host == settings.host or host in anywhere or settings.host in anywhere)
    ):
        raise SettingsError(
            f"--metrics-port {settings.metrics_port} is --port's too, on one address: give "
            "/metrics a port of its own"
        )


def _check_uds(settings: Settings) -> None:
    """https:// over a Unix socket is TLS on the wire and on httpx's transport; aiohttp's
    Unix connector would send the requests in plain text."""
    if (
        settings.upstream_uds is not None
        and UpstreamURL.parse(settings.upstream).tls
        and settings.relay == "asgi"
        and settings.upstream_transport == "aiohttp"
    ):
        raise SettingsError(
            "--upstream-uds with an https:// --upstream takes --upstream-transport httpx on "
            "--relay asgi: aiohttp's Unix socket connector speaks no TLS"
        )


def _check_pair(cert: str | None, key: str | None, cert_flag: str, key_flag: str) -> None:
    """A certificate and its key, both or neither, that load together."""
    if cert is None and key is None:
        return
    if cert is None or key is None:
        given, missing = (cert_flag, key_flag) if key is None else (key_flag, cert_flag)
        raise SettingsError(f"{given} needs {missing}: TLS takes a certificate and its key")
    import ssl

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise SettingsError(
            f"{cert_flag} {cert} {key_flag} {key}: not a certificate and its key ({exc})"
        ) from None


def _check_bundle(path: str | None, flag: str) -> None:
    """A CA bundle that loads."""
    if path is None:
        return
    import ssl

    try:
        ssl.create_default_context(cafile=path)
    except (OSError, ssl.SSLError) as exc:
        raise SettingsError(f"{flag} {path}: not a CA bundle ({exc})") from None


def _check_label_headers(settings: Settings) -> None:
    secret = {h.strip().lower() for h in settings.secret_headers}
    for pair in settings.label_header:
        header = pair.partition("=")[0]
        if header in secret:
            raise SettingsError(
                f"--label-header {pair!r}: {header!r} is a --secret-header; a secret header "
                "never becomes a label (its values never leave the proxy)"
            )


def label_pairs(settings: Settings) -> tuple[tuple[str, str], ...]:
    """--label-header as (header, label) pairs, in the order given."""
    return tuple((p.partition("=")[0], p.partition("=")[2]) for p in settings.label_header)


def require_tokenizer_support(settings: Settings) -> None:
    """--tokenizer without transformers installed cannot be honoured: refuse to start and
    name the extra, instead of running on and counting nothing. Looked up, not imported:
    transformers loads in the background when the proxy starts (proxy/core/tokens.py)."""
    if not settings.tokenizer:
        return
    # a directory that is not there: the proxy would start, fail to load it, count nothing
    if not Path(settings.tokenizer).expanduser().is_dir():
        raise SettingsError(
            f"--tokenizer {settings.tokenizer}: no such directory (a local tokenizer "
            "directory, with its tokenizer.json or vocabulary files)"
        )
    if extras.missing("transformers"):
        raise SettingsError(
            f"--tokenizer {settings.tokenizer}: "
            + extras.needs("the tokenizer", "transformers", "tokenizer")
        )


def parse(argv: Sequence[str], environ: Mapping[str, str]) -> Settings:
    parser = argparse.ArgumentParser(prog="tokenprobe serve")
    add_arguments(parser)
    return resolve(parser.parse_args(list(argv)), environ)


if __name__ == "__main__":  # print the settings table (docs/generate.py writes the page)
    print(settings_table(), end="")
