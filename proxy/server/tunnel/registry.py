"""The WebSocket tunnels open on one server, and the drain that reaches them all.

One registry per server, held by its `TunnelContext`: each tunnel adds itself as it starts
(session.py `Tunnel.__init__`) and leaves only once its end is counted in the sinks, so
whoever sees no tunnel open sees every ended one counted. The wire's end-of-drain cut
(`Wire.close`) and the test listener (tests/ws_proxy.py) both drain through
`shutdown_all`, so the tests of the drain run the code production runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol


class Drainable(Protocol):
    def shutdown(self) -> None: ...


class OpenTunnels:
    """The tunnels open now; iterating yields a snapshot, so a tunnel that ends (and leaves)
    while its neighbours are drained does not disturb the loop."""

    __slots__ = ("_open",)

    def __init__(self) -> None:
        self._open: set[Drainable] = set()

    def add(self, tunnel: Drainable) -> None:
        self._open.add(tunnel)

    def discard(self, tunnel: Drainable) -> None:
        self._open.discard(tunnel)

    def __len__(self) -> int:
        return len(self._open)

    def __iter__(self) -> Iterator[Drainable]:
        return iter(list(self._open))

    def shutdown_all(self) -> None:
        """The drain: close frames both ways on every open tunnel (`Tunnel.shutdown`)."""
        for tunnel in self:
            tunnel.shutdown()
