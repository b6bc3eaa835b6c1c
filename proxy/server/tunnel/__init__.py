"""WebSockets through the proxy: a byte tunnel between the client and the upstream.

The wire's connection protocol parses a request head; when it is a well-formed WebSocket
handshake (`is_websocket_upgrade`, the one check: GET on HTTP/1.1, `Upgrade: websocket`,
`Connection: upgrade`, a key, version 13, no body) for a path that is not the proxy's own,
it stops parsing that connection and, once every response before it on the connection has
ended, calls `take_over` with the head and whatever the client sent after it. Any other
Upgrade (a POST with `Upgrade: websocket` included) is an ordinary request to the HTTP
relay. From then on the tunnel owns both connections, in three parts and one that joins
them:

  handshake.py  the check, the admitted head sent upstream, the upstream's answer read on
                the side, the proxy's own error answers (the HTTP relay's kinds and bodies)
  pipe.py       a byte pipe between two transports: holding, backpressure both ways,
                sealing, the idle timer, the close and its grace; nothing of WebSockets
  watch.py      frames beside the bytes: frame bounds, the API's session fed, the drain's
                close frames at a frame boundary, measuring failures caught
  budget.py     how many frames the watch may read: earned with time, so a flood costs
                a bounded read
  session.py    one tunnel (`take_over`, `TunnelHandle`): its outcome, and its end handed
                to the sinks (`Sinks.session_ended`: Prometheus, OTLP, the access log)
  context.py    what every tunnel of one server shares (`tunnel_context`)
  registry.py   the tunnels open now (`OpenTunnels`), and the drain that reaches them all
"""

from proxy.server.tunnel.context import TunnelContext, tunnel_context
from proxy.server.tunnel.handshake import is_websocket_upgrade
from proxy.server.tunnel.registry import OpenTunnels
from proxy.server.tunnel.session import TunnelHandle, take_over

__all__ = [
    "OpenTunnels",
    "TunnelContext",
    "TunnelHandle",
    "is_websocket_upgrade",
    "take_over",
    "tunnel_context",
]
