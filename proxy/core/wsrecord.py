"""The record of one WebSocket session as the sinks get it, once, when its tunnel ends.

A session's turns (an utterance, a response: its WsApi decides) are Measurements of their
own; this is the tunnel around them: which route, how it ended, when it began, how long
it lasted and what status the client got. Every sink that reports sessions reads the same
record (proxy/sinks/dispatch.py `Sinks.session_ended`): the Prometheus sessions counter and
duration, the OTLP session metrics and the access log's session line. It carries no
header, no path beyond the route label and no content.
"""

from __future__ import annotations

from dataclasses import dataclass

#: How a tunnel ended (the sessions counter's `outcome`, a closed set). A session the
#: upstream accepted ends in one of proxy/core/wsbase.py's CLOSE_CAUSES; one it did not:
#: refused (the upstream answered the upgrade with another status), upstream_unreachable
#: (the connect failed), upstream_timeout (the connect timed out, or no byte of an answer
#: came within --first-byte-timeout: the client's 504 says upstream_timeout too),
#: invalid_request_target (the proxy refused the request target,
#: the HTTP relay's error kind for the same target), upstream_error (the upstream's answer
#: to the upgrade was bytes HTTP/1.1 refuses: the HTTP relay's 502 and error type),
#: too_many_websockets (--ws-max-tunnels were open: the proxy's 503, nothing upstream). With
#: --workers, worker_died: the
#: worker that held the session died (killed, out of memory), counted at the next scrape
#: (proxy/server/multiproc.py) since that worker wrote nothing.
WORKER_DIED = "worker_died"
WS_OUTCOMES = (
    "closed_by_client",
    "closed_by_upstream",
    "client_vanished",
    "upstream_vanished",
    "idle_timeout",
    "shutdown",
    "error",
    "refused",
    "upstream_unreachable",
    "upstream_timeout",
    "upstream_error",
    "invalid_request_target",
    "too_many_websockets",
    WORKER_DIED,
)

#: The `route` of a session on a path no WsApi serves (the others: WS_ENDPOINTS).
OTHER_ROUTE = "other"


@dataclass(frozen=True, slots=True)
class WsSessionRecord:
    """One tunnel, from the upgrade request's arrival to the close of both sides."""

    route: str  # the WsApi's endpoint, else OTHER_ROUTE
    outcome: str  # one of WS_OUTCOMES
    started_at: float  # wall clock (Unix seconds) of the upgrade request's arrival
    duration: float  # seconds from the upgrade request's arrival to the close
    # What the client got: 101 once the upstream switched, the upstream's refusal status,
    # the proxy's own error status (400, 502, 503, 504), 0 when nothing was sent.
    status: int
    # Why the proxy answered the handshake itself, in the HTTP record's words for the
    # same fault (proxy.core.errors.relay_failure's `message`: the address a connect
    # tried included, which the client's answer leaves out); None when it did not.
    error: str | None = None
