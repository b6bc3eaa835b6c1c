"""What every WebSocket tunnel of one server shares, built once from the settings."""

from __future__ import annotations

import ssl
from collections.abc import Callable
from dataclasses import dataclass, field

from proxy.core.paths import under_root
from proxy.core.secrets import secret_names
from proxy.core.upstream_url import UpstreamURL
from proxy.core.wsframes import HeldBytes
from proxy.core.wsseam import WsApi, ws_api_for
from proxy.server.dial import upstream_tls
from proxy.server.tunnel.registry import OpenTunnels
from proxy.settings import Settings, group
from proxy.sinks.dispatch import Sinks

#: The most bytes of half-received messages the frame readers of all a worker's tunnels
#: hold at once: 16 messages at --max-event-bytes' default. A real peer's message
#: arrives whole in a read or two (a realtime append is some 64 KB a second of audio),
#: so only a peer holding messages open reaches it: 40 tunnels each holding a 4 MiB
#: message half-sent took 160 MB more without it.
HELD_MESSAGE_BYTES = 64 * 1024 * 1024


def held_bound(max_message_bytes: int) -> HeldBytes:
    """The shared count of held bytes, bounded so that one message as large as a reader
    takes (`max_message_bytes`) always fits when no other is held."""
    return HeldBytes(max(HELD_MESSAGE_BYTES, max_message_bytes))


@dataclass(eq=False)
class TunnelContext:
    """What every tunnel of one server shares; built once by `tunnel_context`."""

    upstream: UpstreamURL  # the one parse every data path uses
    ssl: ssl.SSLContext | None  # for an https:// upstream
    connect_timeout: float
    first_byte_timeout: float  # for the answer to the handshake, as for an HTTP request's
    ws_idle_timeout: float  # an open tunnel's silence either way
    # A refusal's silence before its body's end (an ordinary response, read as the HTTP
    # relay reads one: --idle-timeout)
    idle_timeout: float
    max_message_bytes: int  # largest message a FrameReader assembles (--max-event-bytes)
    sinks: Sinks  # each session's start and end, its turns' records, measuring failures
    secret_headers: frozenset[bytes]  # as the HTTP relay's (proxy/server/admission.py)
    apis: Callable[[str], WsApi | None] = ws_api_for
    close_grace: float = 2.0  # seconds a closing side gets to take its last bytes
    ssl_certfile: str | None = None  # the proxy serves https: a redirect to it says so
    # open now: the one registry the wire's drain and the test listener's go through
    tunnels: OpenTunnels = field(default_factory=OpenTunnels)
    # --ws-max-tunnels: a handshake that would open one more is answered 503 (session.py)
    ws_max_tunnels: int = 4096
    # the bytes every tunnel's frame readers hold of half-received messages, and their
    # bound (`held_bound`): the watch of a message that would go past it is skipped
    held: HeldBytes = field(default_factory=lambda: HeldBytes(HELD_MESSAGE_BYTES))


def tunnel_context(settings: Settings, sinks: Sinks) -> TunnelContext:
    """The tunnels' shared parts for these settings; call once per server."""
    upstream = UpstreamURL.parse(settings.upstream, settings.upstream_uds)
    return group(
        TunnelContext,
        settings,
        upstream=upstream,
        ssl=upstream_tls(settings),
        max_message_bytes=settings.max_event_bytes,
        held=held_bound(settings.max_event_bytes),
        sinks=sinks,
        secret_headers=secret_names(settings.secret_headers),
        apis=routed(settings.root_path),
    )


def routed(root_path: str | None) -> Callable[[str], WsApi | None]:
    """The WebSocket API of a path as the backend routes it: after --root-path, as the
    HTTP relay measures (proxy/core/paths.py `under_root`; vLLM's WebSocket routes, its
    /v1/realtime, go through the same root path as its HTTP ones)."""
    if root_path is None:
        return ws_api_for
    return lambda path: ws_api_for(under_root(path, root_path))
