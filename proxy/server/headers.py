"""The header policy of both data paths: what goes upstream, what comes back, what is secret
(the secret names and their masking: proxy/core/secrets.py).

Hop-by-hop headers (RFC 9110 §7.6.1) and those a Connection header names stop at the
proxy in both directions. `Expect` is dropped: the proxy has read the whole body already
(it answered the client's 100-continue when it did); passed on, the upstream would wait
for a 100 of its own. A measured request asks for an uncompressed response, because the
observer reads the stream. The client's address (`client_address`, read alike from every
path's peer) goes last in X-Forwarded-For (`forwarded_for`). An event stream going to the
client says `x-accel-buffering: no` (unless the upstream said it already: llama-server
does), so an nginx in front does not buffer it. A WebSocket handshake
(proxy/server/tunnel/handshake.py) passes the same policy (`handshake_headers`), keeping only what
the protocol is made of: Upgrade, Connection and the Sec-WebSocket-* headers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proxy.core.upstream_url import UpstreamURL

Headers = list[tuple[bytes, bytes]]

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",  # RFC 9110 §7.6.1: removed whether or not Connection names it
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)
_REQUEST_DROP = HOP_BY_HOP | {b"host", b"content-length", b"accept-encoding", b"expect"}
_RESPONSE_DROP_CHANGED = HOP_BY_HOP | {b"content-length"}


def upstream_headers(
    headers: Headers,
    *,
    measured: bool,
    trace: Headers | None = None,
    client: str | None = None,
) -> Headers:
    """The client's (lower-case) request headers as they go upstream. `trace` are the
    proxy's own trace headers: its span is the client's span's child, so they replace the
    client's and the backend sees exactly one traceparent. `client`: the client's address,
    added to X-Forwarded-For (`forwarded_for`)."""
    named = _named_by_connection(headers)
    drop = _REQUEST_DROP | named if named else _REQUEST_DROP
    if trace:
        drop = drop | {name for name, _ in trace} | {b"tracestate"}
    out = [(k, v) for k, v in headers if k not in drop]
    if measured:
        # vLLM does not compress its streams anyway.
        out.append((b"accept-encoding", b"identity"))
    elif b"accept-encoding" not in named:  # named by Connection, it is hop-by-hop
        out.extend((k, v) for k, v in headers if k == b"accept-encoding")
    if trace:
        out.extend(trace)
    return out if client is None else forwarded_for(out, client)


def forwarded_for(headers: Headers, client: str) -> Headers:
    """`headers` with the client's address last in X-Forwarded-For, after any the client
    sent (joined into one field), as nginx's `$proxy_add_x_forwarded_for` and Envoy do. A
    backend that trusts the proxy's address for the header (vLLM's uvicorn trusts
    127.0.0.1 by default, --forwarded-allow-ips) then logs the client the proxy saw, not
    one a client wrote into the header itself: it reads the last entry it does not trust."""
    prior = [value for name, value in headers if name == b"x-forwarded-for"]
    out = [pair for pair in headers if pair[0] != b"x-forwarded-for"] if prior else headers
    out.append((b"x-forwarded-for", b", ".join((*prior, client.encode("latin-1")))))
    return out


def client_address(peer: object) -> str | None:
    """The client's address as X-Forwarded-For names it, from whichever form a data path
    holds its peer in: uvicorn's `client` (host, port) on the wire, an ASGI scope's
    `client` (a list or tuple, or None), a transport's `peername` in the tunnel (a
    4-tuple over IPv6; a str, or nothing, over a Unix socket: no address, None)."""
    if isinstance(peer, tuple | list) and peer:
        return str(peer[0])
    return None


def handshake_headers(headers: Headers, client: str | None = None) -> Headers:
    """A WebSocket handshake's (lower-case) request headers as they go upstream: the same
    policy as an HTTP request's (X-Forwarded-For included), then the two hop-by-hop
    headers the handshake is made of (RFC 6455 §4.1). A Connection header cannot name the
    Sec-WebSocket-* headers away: without them there is no handshake."""
    named = _named_by_connection(headers)
    drop = {name for name in _REQUEST_DROP | named if not name.startswith(b"sec-websocket-")}
    if b"accept-encoding" not in named:
        drop.discard(b"accept-encoding")  # in _REQUEST_DROP only to go last; here it stays
    out = [(k, v) for k, v in headers if k not in drop]
    if client is not None:
        out = forwarded_for(out, client)
    out.extend(_HANDSHAKE)
    return out


_HANDSHAKE = ((b"upgrade", b"websocket"), (b"connection", b"Upgrade"))


def _named_by_connection(headers: Headers) -> frozenset[bytes]:
    """The (lower-case) names every Connection header lists: they stop at the proxy too
    (RFC 9110 §7.6.1: a proxy MUST remove them, both ways), whatever they are, so the
    Accept-Encoding a request's policy adds back as well."""
    named: frozenset[bytes] = frozenset()
    for name, value in headers:
        if name == b"connection":
            named = named | {t.strip().lower() for t in value.split(b",")}
    return named


def client_headers(headers: Headers, content_type: bytes, *, body_changes: bool) -> Headers:
    """The upstream's (lower-case) response headers as they go to the client;
    `body_changes` when the proxy strips part of the body (its length no longer holds)."""
    drop = _RESPONSE_DROP_CHANGED if body_changes else HOP_BY_HOP
    named = _named_by_connection(headers)
    if named:
        drop = drop | (named if body_changes else named - {b"content-length"})
        # (named by Connection, a Content-Length still frames the body it came with)
    out = [(k, v) for k, v in headers if k not in drop]
    if content_type.startswith(b"text/event-stream") and not any(
        k == b"x-accel-buffering" for k, _ in out
    ):  # the upstream's own (llama-server sends one) stands
        out.append((b"x-accel-buffering", b"no"))
    return out


def redirect_ends(upstream: UpstreamURL, tls: bool, headers: Headers) -> tuple[bytes, bytes]:
    """`redirected`'s two ends: the upstream's scheme://authority and base path, and the
    proxy's scheme://host as the client named it in `headers` (its request's, names in
    lower case as every ASGI server and the wire's llhttp callbacks give them; https when
    the proxy serves TLS), or b"" when the client named no Host (HTTP/1.0 without one):
    no name of the proxy's to point at, so the Location becomes a path, which keeps the
    client on whatever address it came by and never shows it the upstream's. The
    protocol refuses two Hosts (protocol.py `_head_wrong`), so the first is the one. The
    HTTP relay's and the WebSocket tunnel's alike (a handshake is HTTP/1.1: it has a
    Host)."""
    host = next((value for name, value in headers if name == b"host"), None)
    within = f"{upstream.origin}{upstream.base_path}".encode("ascii")
    if host is None:
        return within, b""
    return within, (b"https" if tls else b"http") + b"://" + host


def redirected(headers: Headers, upstream: bytes, client: bytes) -> Headers:
    """The response headers with a `Location` that points into the upstream's URL
    (`upstream`: scheme://authority and base path) pointing at the proxy instead
    (`client`: the scheme and Host the client used), as nginx's `proxy_redirect default`
    does. A backend builds an absolute redirect from the Host it was sent, the upstream's
    (Starlette's redirect_slashes in vLLM: `http://vllm:8000/v1/models`), which a client
    may not reach and which would take it around the proxy. With no `client` (no Host)
    the rest of the URL becomes a path-absolute reference (RFC 9110 §10.2.2 allows a
    relative Location)."""
    out: Headers = []
    for name, value in headers:
        if (
            name == b"location"
            and value.startswith(upstream)
            and value[len(upstream) : len(upstream) + 1] in (b"", b"/", b"?", b"#")
        ):
            rest = value[len(upstream) :]
            value = client + rest if client else _as_path(rest)
        out.append((name, value))
    return out


def _as_path(rest: bytes) -> bytes:
    """What follows the upstream's URL in a Location, as a path-absolute reference: `/`
    for none, and never one that begins with `//`, which a client reads as another host
    (`//evil.example/x`, a network-path reference): `/.` before it is removed as a dot
    segment when the client resolves it (RFC 3986 §5.2.4), leaving the path."""
    if not rest.startswith(b"/"):
        return b"/" + rest
    return b"/." + rest if rest.startswith(b"//") else rest
