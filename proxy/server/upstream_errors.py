"""What the upstream clients raise of their own (proxy/server/upstream.py and its aiohttp
transport, proxy/server/upstream_aiohttp.py; the wire's, proxy/server/wire/). What they mean
for a request is decided in proxy/core/errors.py."""

from __future__ import annotations

from proxy.core.errors import Told


class UpstreamProtocolError(Told):
    """The upstream broke HTTP/1.1 on a connection, which is closed; `kind` is its label in
    tokenprobe_upstream_protocol_errors_total (proxy/sinks/metrics.py). Its message is the
    proxy's own words for the fault (UPSTREAM_FAULTS, where a path met it in other words),
    which `describe` tells over the transport's exception beneath, if any (h11's)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class UpstreamClosed(Told, ConnectionError):
    """The upstream closed the connection cleanly (a FIN, no reset) before the response
    ended. The wire raises it, "the upstream closed the connection before ..."; the ASGI
    relay's transports say the same in their own words (httpx's RemoteProtocolError "peer
    closed connection without sending complete message body", aiohttp's
    ContentLengthError). A reset is the system's ConnectionResetError ("Connection reset by
    peer") on every path. A ConnectionError, like a reset, so proxy/core/errors.py gives
    both the same error kind: only the words tell them apart. Told: every path says it in
    UPSTREAM_FAULTS' words (`closed_early`), over the transport's own beneath."""


class ClosedUnanswered(Exception):
    """The backend closed a reused keep-alive connection before any byte of the answer to
    the request on it: `send_upstream` sends that request once more, on a new connection.
    Raised as the transport's own disconnect error (`_AiohttpClosedUnanswered`,
    `_HttpxClosedUnanswered`), so where it is not caught it means what that error means."""


class ClosedInHead(Exception):
    """The backend closed the connection cleanly after a byte of its answer and before the
    end of its final response head (a status line and a header, a 1xx and no more), as the
    wire's `_closed_early` tells it: `send_upstream` raises `UpstreamClosed` in its words
    ("before the end of the response head"), and never sends the request again (the
    backend took it). Raised as the transport's own disconnect error
    (`_AiohttpClosedInHead`, `_HttpxClosedInHead`), as `ClosedUnanswered` is."""
