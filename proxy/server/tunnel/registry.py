"""The WebSocket tunnels open on one server, and the drain that reaches them all.

One registry per server, held by its `TunnelContext`: each tunnel adds itself as it starts
(session.py `Tunnel.__init__`) and leaves only once its end is counted in the sinks, so
whoever sees no tunnel open sees every ended one counted. The wire's end-of-drain cut
(`Wire.close`) and the test listener (tests/ws_proxy.py) both drain through
`shutdown_all`, so the tests of the drain run the code production runs. It also says in
the log when handshakes are shed at --ws-max-tunnels (session.py `over_cap`), at most
once a `SAY_EVERY` seconds: a client retrying at once would write a line a handshake.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from time import monotonic
from typing import Protocol

log = logging.getLogger("tokenprobe")

#: The fewest seconds between two log lines about shed handshakes.
SAY_EVERY = 60.0


class Drainable(Protocol):
    def shutdown(self) -> None: ...


class OpenTunnels:
    """The tunnels open now; iterating yields a snapshot, so a tunnel that ends (and leaves)
    while its neighbours are drained does not disturb the loop."""

    __slots__ = ("_open", "_said_at", "_shed")

    def __init__(self) -> None:
        self._open: set[Drainable] = set()
        self._shed = 0  # handshakes shed since the last line said so
        self._said_at = -SAY_EVERY  # monotonic() of that line

    def add(self, tunnel: Drainable) -> None:
        self._open.add(tunnel)

    def discard(self, tunnel: Drainable) -> None:
        self._open.discard(tunnel)

    def __len__(self) -> int:
        return len(self._open)

    def __iter__(self) -> Iterator[Drainable]:
        return iter(list(self._open))

    def shedding(self, limit: int) -> None:
        """A handshake was shed at `limit` tunnels: said now, or with the next line."""
        self._shed += 1
        now = monotonic()
        if now - self._said_at < SAY_EVERY:
            return
        log.warning(
            "refused %d WebSocket handshake(s) with 503: %d tunnels open, the most "
            "--ws-max-tunnels allows",
            self._shed,
            limit,
        )
        self._shed, self._said_at = 0, now

    def shutdown_all(self) -> None:
        """The drain: close frames both ways on every open tunnel (`Tunnel.shutdown`)."""
        for tunnel in self:
            tunnel.shutdown()
