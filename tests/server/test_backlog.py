"""proxy/server/backlog.py: what a connection owes its peer moves when the peer reads,
though the transport's own buffer does not."""

from __future__ import annotations

import asyncio
import socket
import sys

import pytest

from proxy.server.backlog import owed
from tests.server.conftest import no_proxy

pytestmark = no_proxy


@pytest.mark.skipif(sys.platform != "linux", reason="SIOCOUTQ is Linux's")
def test_a_slow_reader_moves_what_is_owed_while_the_transport_buffer_stands_still() -> None:
    async def main() -> tuple[int, int, int, int]:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            theirs = socket.socket()
            theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            theirs.connect(listener.getsockname())
            ours, _ = listener.accept()
        theirs.setblocking(False)
        transport, _ = await asyncio.get_running_loop().create_connection(
            asyncio.Protocol, sock=ours
        )
        try:
            transport.write(b"x" * (4 * 2**20))  # far more than the sockets hold
            await asyncio.sleep(0.05)
            before = (owed(transport), transport.get_write_buffer_size())
            taken = theirs.recv(4096)  # the peer takes a little
            await asyncio.sleep(0.05)
            after = (owed(transport), transport.get_write_buffer_size())
            return (*before, *after) if taken else (0, 0, 0, 0)
        finally:
            transport.abort()
            theirs.close()

    owed_before, buffer_before, owed_after, buffer_after = asyncio.run(main())
    assert owed_before > buffer_before > 0
    assert owed_after < owed_before  # the read shows at once
    assert buffer_after == buffer_before  # the transport's buffer alone would not have told
