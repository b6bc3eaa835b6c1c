"""The WebSocket API seam: what one WebSocket API measures from the messages of a session.

An HTTP API (proxy/core/apis) reads one request and one response; a WebSocket API reads a
session: messages both ways, each with the time of the network read that completed it.
The tunnel (proxy/server/tunnel.py) opens a `WsSession` when the upstream answers 101 on
a path with a `WsApi`, feeds it every message of both directions (after the bytes went
on to the other side), and closes it once when the tunnel ends. A session hands each
finished Measurement (a turn, an utterance: the API decides) to `record`, which takes it
to the sinks. An exception raised here is caught by the tunnel, counted in
`tokenprobe_measurement_failures_total{stage="observe"}` (or `finish` from `close`), and
the session is no longer watched; the bytes keep flowing.

Adding a WebSocket API is one module defining a WsApi and one line in `WS_APIS` below.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from proxy.core.measurement import Measurement
from proxy.core.wsframes import WsMessage

#: WsSession.close causes: how a tunnel ended (also the sessions counter's `outcome`).
CLOSE_CAUSES = frozenset(
    {
        "closed_by_client",  # the client sent the first close frame
        "closed_by_upstream",  # the upstream sent the first close frame
        "client_vanished",  # the client's connection ended without a close frame
        "upstream_vanished",  # the upstream's connection ended without a close frame
        "idle_timeout",  # no byte either way for --ws-idle-timeout
        "shutdown",  # the proxy drained on SIGTERM (close frames 1001 both ways)
        "error",  # the proxy failed
    }
)


class WsSession:
    """One WebSocket session's measuring state; the base measures nothing."""

    def message(self, msg: WsMessage) -> None:
        """One message or control frame from either side (msg.from_client says which)."""

    def close(self, at: float, cause: str) -> None:
        """The tunnel ended at `at` (perf_counter) for `cause` (one of CLOSE_CAUSES).
        Called once; a session records what is still open here."""


class WsApi:
    """A WebSocket API: its endpoint label, the paths it serves, and a session factory."""

    endpoint: ClassVar[str]  # the label value: its canonical path
    paths: ClassVar[tuple[str, ...]]  # normalised paths (no query) it serves

    def open(
        self,
        *,
        start: float,
        started_at: float,
        path: str,
        query: str,
        record: Callable[[Measurement], None],
    ) -> WsSession:
        """A session for one tunnel: `start` (perf_counter) and `started_at` (wall clock)
        are when the upgrade request arrived; `record` takes a finished Measurement to
        the sinks."""
        raise NotImplementedError


#: Every measured WebSocket API, one line each.
WS_APIS: tuple[WsApi, ...] = ()

_BY_PATH = {path: api for api in WS_APIS for path in api.paths}
#: The closed set of WebSocket `route` label values besides "other".
WS_ENDPOINTS = frozenset(api.endpoint for api in WS_APIS)


def ws_api_for(path: str) -> WsApi | None:
    """The WsApi serving this normalised path, or None (tunnelled unmeasured)."""
    return _BY_PATH.get(path)
