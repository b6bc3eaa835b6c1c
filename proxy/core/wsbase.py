"""What every WebSocket API seam provides: `WsApi` (endpoint, paths, a session factory),
`WsSession` (messages in, records out) and the tunnel's close causes. The registry of
WebSocket APIs and `ws_api_for` are in proxy/core/wsseam.py, which the seams' modules do
not import (as proxy/core/apis/base.py is to proxy/core/apis/__init__.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from proxy.core.measurement import ErrorType, Measurement
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

    def refused(self, at: float, status: int, error: ErrorType, message: str) -> None:
        """The upstream answered the upgrade with an error `status` whose answer ended at
        `at`, classified `error` (`message`: what its body says): nothing was opened. An
        API's session records it as the HTTP relay records a refused request, so that a
        401 to a realtime upgrade counts among the auth errors, under its key."""


class WsApi:
    """A WebSocket API: its endpoint label, the paths it serves, and a session factory."""

    endpoint: ClassVar[str]  # the label value: its canonical path
    paths: ClassVar[tuple[str, ...]]  # normalised paths (no query) it serves
    bench_name: ClassVar[str] = ""  # its `tokenprobe bench --endpoint` choice, "" for none
    #: As an HTTP Api's (proxy/core/apis/base.py): its records' SLOs, spans and OTLP metrics.
    generative: ClassVar[bool] = True
    operation: ClassVar[str] = "chat"  # gen_ai.operation.name
    provider: ClassVar[str] = "openai"  # gen_ai.provider.name

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
