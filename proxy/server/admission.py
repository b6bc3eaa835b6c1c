"""Admission, for both data paths: which requests go upstream, as what, and the proxy's
own answers to those that do not.

In order: the one normalised target (proxy/core/paths.py; routed, measured and forwarded
alike: `own_route` decides on it whether the proxy answers a request itself, on both data
paths, so no spelling of /metrics reaches the backend), the head's limits (`check_head`:
header bytes 431, a declared body over the limit 413), the body's (`check_body`: 413), then `admit`: the API seam decides (a POST to a path
that has an Api is measured), `parse_request` reads the body once, and a stream whose
client asked for no usage is asked for it, with a `UsageEventStripper` to take it out of
the client's stream again. A refusal is one exception (`Refused`) carrying its answer;
`count_refusal` records it; `error_answer` is the one shape of every answer the proxy
writes itself (before any upstream byte reached the client), `answer_bytes` the same as
HTTP/1.1 bytes.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from proxy.core.apis import LLAMACPP_PATHS, Api, api_for
from proxy.core.errors import error_body, error_shape
from proxy.core.identity import UNKNOWN
from proxy.core.labels import route_template
from proxy.core.measurement import ErrorType
from proxy.core.paths import BadTarget, Target, normalise, route_key
from proxy.core.request import RequestInfo, parse_request
from proxy.core.secrets import secret_names
from proxy.core.strip import Injection, UsageEventStripper
from proxy.server.dial import upstream_tls
from proxy.server.headers import Headers
from proxy.settings import Settings, group
from proxy.sinks.dispatch import Sinks

log = logging.getLogger("tokenprobe")


@dataclass(frozen=True, slots=True)
class RelaySettings:
    """What both data paths read from the settings, once, at startup (`relay_settings`,
    through settings.group: a field named like a setting is that setting)."""

    upstream: str  # base URL, no trailing path
    # --root-path: a request under it is measured by the path after it (paths.under_root)
    root_path: str | None
    upstream_uds: str | None  # the Unix socket connections go to, else the URL's host and port
    upstream_ssl: ssl.SSLContext | None  # for an https:// upstream (proxy/server/dial.py)
    inject_usage: bool  # ask a stream for usage when its client did not, and strip it back
    max_body_bytes: int
    max_header_bytes: int
    max_event_bytes: int
    body_timeout: float  # for the client's request body
    connect_timeout: float  # to open an upstream connection
    first_byte_timeout: float  # from the upstream request to its response head
    idle_timeout: float  # the longest gap between two chunks of an upstream body
    secret_headers: frozenset[bytes]  # lower-case names whose values never leave the proxy
    ssl_certfile: str | None  # the proxy serves TLS: its clients' scheme is https
    # Whether usage is still asked for: off for good once a stream could not be given back
    # (proxy/core/strip.py); the one mutable part, shared by every request to the upstream.
    injection: Injection = field(default_factory=Injection)


def relay_settings(settings: Settings) -> RelaySettings:
    return group(
        RelaySettings,
        settings,
        secret_headers=secret_names(settings.secret_headers),
        upstream_ssl=upstream_tls(settings),
    )


class Refused(Exception):
    """A request the proxy answers itself, before anything goes upstream."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


class ClientGone(Exception):
    """The client left while sending its request."""


def target(raw_path: bytes, query: bytes) -> Target:
    try:
        return normalise(raw_path, query)
    except BadTarget as exc:
        raise Refused(400, "invalid_request_target", str(exc)) from None


def own_route(where: Target | Refused, owns: Callable[[str], bool]) -> str | None:
    """The proxy's own route a request is for, decided on its normalised target
    (`route_key`: `/v1/../metrics`, `//metrics` and `/metrics/` are all /metrics), or None
    when the request is the backend's (a target that cannot be normalised is the relay's
    to refuse). `owns` says which keys are the proxy's: while /metrics is served on this
    port, every key that begins with `/metrics` (`/metrics;x`, `/metricsX`, which a vLLM
    answers with its exposition: proxy/server/control.py), so none reaches the backend."""
    if isinstance(where, Refused):
        return None
    key = route_key(where.path)
    return key if owns(key) else None


def where_to(raw_path: bytes, query: bytes) -> Target | Refused:
    """`target`, with the refusal returned instead of raised."""
    try:
        return target(raw_path, query)
    except Refused as refusal:
        return refusal


#: The backend kinds that may be llama-server: it, and a backend the proxy does not know,
#: for a `llama-server --api-key` answers its probes 401 and stays `unknown`
#: (docs/llamacpp.md).
MAY_BE_LLAMACPP = frozenset({"llamacpp", UNKNOWN})


def measured_api(method: str, path: str, backend: str = UNKNOWN) -> Api | None:
    """The seam decides: a POST to a path that has an Api is measured, the rest is not;
    llama-server's own paths (`LLAMACPP_PATHS`: `/chat/completions`, `/completion`...)
    only in front of a backend that may be llama-server (`backend`: the upstream's kind,
    as far as it is known, proxy/core/identity.py). Before the first answer to the
    proxy's questions, the kind is `unknown`: they are measured."""
    if method != "POST" or (path in LLAMACPP_PATHS and backend not in MAY_BE_LLAMACPP):
        return None
    return api_for(path)


def check_head(headers: Headers, limits: RelaySettings) -> None:
    """The limits a request head can break before its body is read (431, 413)."""
    header_bytes = 0
    for name, value in headers:
        header_bytes += len(name) + len(value)
        if name == b"content-length" and value.isdigit() and int(value) > limits.max_body_bytes:
            raise body_too_large(limits.max_body_bytes)
    if header_bytes > limits.max_header_bytes:
        raise Refused(
            431,
            "request_header_fields_too_large",
            f"request headers over {limits.max_header_bytes} bytes",
        )


def body_too_large(limit: int) -> Refused:
    return Refused(413, "request_too_large", f"request body over {limit} bytes")


BODY_TIMEOUT = Refused(408, "request_timeout", "request body not received in time")


#: llama-server keeps the bytes of a stream sent with this header and replays them on
#: `GET /v1/stream?conv_id=<id>&from=N` (tools/server/server-stream.cpp,
#: server_stream_conv_id_from_headers and server_stream_make_get_handler). A usage chunk
#: the proxy asked for and took out again would be in that replay though the client never
#: got it, so a resume at the client's byte count would start inside it.
RESUMABLE_STREAM = b"x-conversation-id"
#: The backend kinds (proxy/core/identity.py) that may replay such a stream: those that
#: may be llama-server (`MAY_BE_LLAMACPP`). No other engine replays by that header
#: (vLLM 0.32 has no /v1/stream), and there it cost the usage chunk: tokens counted from
#: the chunks, 8 for vLLM's 33 with speculative decoding. Of the two errors an unknown
#: backend risks, an undercount is the lesser: a wrong byte offset breaks a client's resume.
MAY_REPLAY = MAY_BE_LLAMACPP


def admit(
    api: Api,
    body: bytes,
    limits: RelaySettings,
    backend: str = UNKNOWN,
    headers: Sequence[tuple[bytes, bytes]] = (),
) -> tuple[RequestInfo, bytes, UsageEventStripper | None]:
    """A measured request's info, the body that goes upstream, and the stripper when the
    proxy asked for usage the client did not. `backend`: the upstream's kind, as far as
    it is known (proxy/core/identity.py); the API may not ask some kinds for usage.
    `headers`: the client's (lower-case names); a stream the backend may replay
    (`RESUMABLE_STREAM`, in front of a backend of `MAY_REPLAY`) is never asked for usage,
    so the replay holds exactly the bytes the client got."""
    info, obj = parse_request(api, body)
    if (
        limits.inject_usage
        and limits.injection.asks(api.endpoint)
        and info.stream
        and not info.usage_requested
        and obj is not None
        and backend not in api.usage_reshapes
        and not (backend in MAY_REPLAY and any(name == RESUMABLE_STREAM for name, _ in headers))
    ):
        asked = api.ask_for_usage(obj, body)
        if asked is not None:  # the client gets the stream it asked for: strip the extra
            stripper = UsageEventStripper(limits.max_event_bytes, limits.injection, api.endpoint)
            return info, asked, stripper
    return info, body, None


def stops_asking(sinks: Sinks, how: str) -> None:
    """A stream the proxy asked usage of reached its client with that usage chunk
    (Injection.leaked: compressed, or an event stream under another label): the proxy
    stops asking that upstream, counted as any stop (`tokenprobe_measurement_failures_total
    {stage="usage_injection"}`) and said once, as the leak it could not prevent."""
    sinks.count_measurement_failure("usage_injection")
    log.warning(
        "the upstream sent a stream the proxy had asked usage of %s, and only an identity "
        "body labelled text/event-stream can be stripped: its client got the usage chunk "
        "the proxy had asked for; the proxy no longer asks this upstream for usage",
        how,
    )


def count_refusal(
    sinks: Sinks,
    path: str,
    api: Api | None,
    status: int,
    start: float,
    started_at: float,
    error: ErrorType = ErrorType.BAD_REQUEST,
    message: str | None = None,
) -> None:
    """A refused request (or one that never got an answer, `status` 0: its client left, or
    the drain's end dropped it before its turn): a bare record if it was for a measured
    API, with `message` (the proxy's own answer's), else a passthrough count by route of
    one that was answered."""
    if api is not None:
        info, _ = parse_request(api, b"")
        sinks.refused(info, error, status, start, started_at, message)
    elif status:
        sinks.passthrough(route_template(path), status)


def error_answer(status: int, kind: str, message: str, path: str | None) -> tuple[Headers, bytes]:
    """An answer from the proxy itself, shaped for the clients of `path` (OpenAI's shape
    where no path is known yet)."""
    shape = "openai" if path is None else error_shape(path)
    body = error_body(status, kind, message, shape=shape)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    return headers, body


def answer_bytes(
    status: int, kind: str, message: str, path: str | None, *, close: bool, head_only: bool = False
) -> bytes:
    """`error_answer` as HTTP/1.1 bytes, for the paths that write to the socket themselves
    (the wire, the head guard, the tunnel); `close` says the connection closes after it."""
    headers, body = error_answer(status, kind, message, path)
    lines = [STATUS_LINE[status]]
    lines.extend(b"%s: %s\r\n" % pair for pair in headers)
    if close:
        lines.append(b"connection: close\r\n")
    lines.append(b"\r\n")
    if not head_only:
        lines.append(body)
    return b"".join(lines)
