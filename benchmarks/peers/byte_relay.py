"""The floor: a TCP byte relay on uvloop. It moves bytes and nothing else.

Every proxy must at least read each chunk from one socket and write it to another; this
does exactly that (no HTTP parsing, no copies beyond the kernel's), so its CPU per chunk
is what any Python-hosted relay has to spend. Backpressure is passed through both ways.

    python benchmarks/peers/byte_relay.py --port 9001 --upstream-port 9000
"""

from __future__ import annotations

import argparse
import asyncio


class Pipe(asyncio.Protocol):
    """One side of a relayed connection; `peer` is the other side."""

    def __init__(self, peer: Pipe | None = None) -> None:
        self.peer = peer
        self.transport: asyncio.Transport | None = None
        self.early: list[bytes] = []  # client bytes that came before the upstream connected

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is None or peer.transport is None:
            self.early.append(data)
        else:
            peer.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()


class Downstream(Pipe):
    """A client connection: open the upstream connection and join the two."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        super().__init__()
        self.upstream = upstream

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, up = await loop.create_connection(lambda: Pipe(self), *self.upstream)
        except OSError:
            assert self.transport is not None
            self.transport.close()
            return
        self.peer = up
        for data in self.early:
            up.transport.write(data)  # type: ignore[union-attr]
        self.early.clear()


async def serve(port: int, upstream: tuple[str, int]) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Downstream(upstream), "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream-port", type=int, required=True)
    parser.add_argument("--upstream-host", default="127.0.0.1")
    args = parser.parse_args()
    import uvloop

    uvloop.run(serve(args.port, (args.upstream_host, args.upstream_port)))


if __name__ == "__main__":
    main()
