"""What every WebSocket tunnel of one server shares, built once from the settings."""

from __future__ import annotations

import ssl
from collections.abc import Callable
from dataclasses import dataclass, field

from proxy.core.secrets import secret_names
from proxy.core.upstream_url import UpstreamURL
from proxy.core.wsseam import WsApi, ws_api_for
from proxy.server.dial import upstream_tls
from proxy.server.tunnel.registry import OpenTunnels
from proxy.settings import Settings, group
from proxy.sinks.dispatch import Sinks


@dataclass(eq=False)
class TunnelContext:
    """What every tunnel of one server shares; built once by `tunnel_context`."""

    upstream: UpstreamURL  # the one parse every data path uses
    ssl: ssl.SSLContext | None  # for an https:// upstream
    connect_timeout: float
    first_byte_timeout: float  # for the answer to the handshake, as for an HTTP request's
    idle_timeout: float  # --ws-idle-timeout
    max_message_bytes: int  # largest message a FrameReader assembles (--max-event-bytes)
    sinks: Sinks  # each session's start and end, its turns' records, measuring failures
    secret_headers: frozenset[bytes]  # as the HTTP relay's (proxy/server/admission.py)
    apis: Callable[[str], WsApi | None] = ws_api_for
    close_grace: float = 2.0  # seconds a closing side gets to take its last bytes
    ssl_certfile: str | None = None  # the proxy serves https: a redirect to it says so
    # open now: the one registry the wire's drain and the test listener's go through
    tunnels: OpenTunnels = field(default_factory=OpenTunnels)


def tunnel_context(settings: Settings, sinks: Sinks) -> TunnelContext:
    """The tunnels' shared parts for these settings; call once per server."""
    upstream = UpstreamURL.parse(settings.upstream, settings.upstream_uds)
    return group(
        TunnelContext,
        settings,
        upstream=upstream,
        ssl=upstream_tls(settings),
        idle_timeout=settings.ws_idle_timeout,
        max_message_bytes=settings.max_event_bytes,
        sinks=sinks,
        secret_headers=secret_names(settings.secret_headers),
    )
