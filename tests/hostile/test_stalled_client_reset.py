"""A client that stays connected and takes nothing is cut at --idle-timeout (its
connection aborted, `client_cancelled`): the cut leaves nothing of the proxy's socket to
it behind, on both data paths.

Before: asyncio's and uvloop's abort() drop only the transport's buffer; the kernel's
send queue (about 3.9 MB on loopback) stayed, the close queued its FIN behind it, and the
socket sat in FIN-WAIT-1 on a persist timer for minutes (still there 230 s after the cut
on the wire), since a live client answers the zero-window probes. Now the socket is
closed with SO_LINGER 0: the queue dropped, the client reset at once. The proxy's sockets
are read from /proc/net/tcp, as `ss -tn state fin-wait-1 sport = :PORT` shows them.

Shown able to fail: the test failed on the tree before the fix, on both paths.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from tests.hostile.peers import Conn, RawUpstream, Request, by_target
from tests.hostile.shared import counted_when, until
from tests.scrape import REQUESTS

Proxy = Callable[..., AbstractContextManager[str]]
TCP_TABLE = Path("/proc/net/tcp")
_FIN_WAIT1 = "04"  # include/net/tcp_states.h, as /proc/net/tcp writes it

pytestmark = pytest.mark.skipif(not TCP_TABLE.exists(), reason="reads Linux's /proc/net/tcp")


def proxy_sockets(proxy_port: int, client_port: int) -> list[tuple[str, int]]:
    """The proxy's sockets to the client on `client_port`: (state, bytes in the send
    queue) each, as the kernel has them."""
    found = []
    for line in TCP_TABLE.read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, state, queues = fields[1], fields[2], fields[3], fields[4]
        if int(local.rsplit(":", 1)[1], 16) == proxy_port and (
            int(remote.rsplit(":", 1)[1], 16) == client_port
        ):
            found.append((state, int(queues.split(":")[0], 16)))
    return found


def endless() -> Callable[[Conn, Request], object]:
    """An upstream that streams 60 KB chat events as fast as it is read, until the proxy
    closes on it."""
    text = b"x" * 60_000
    event = b'data: {"choices":[{"index":0,"delta":{"content":"%s"}}]}\n\n' % text
    chunk = b"%x\r\n%s\r\n" % (len(event), event)

    async def stream(conn: Conn, request: Request) -> None:
        conn.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        while True:
            conn.write(chunk)
            await asyncio.wait_for(conn.drain(), 30)

    return stream


def test_a_stalled_clients_cut_leaves_no_socket_holding_its_queue(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """The client takes nothing of a fast stream; once cut, within seconds no socket of
    the proxy's to it is left (before: FIN-WAIT-1, about 3.9 MB queued, for minutes)."""
    upstream.default = by_target({b"/v1/chat/completions": endless()})
    body = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'
    with proxy(upstream.url, "--idle-timeout", "1") as base, socket.socket() as sock:
        host, port = base.removeprefix("http://").rsplit(":", 1)
        sock.connect((host, int(port)))
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )
        client_port = sock.getsockname()[1]
        cut = counted_when(base, REQUESTS, 1, error_type="client_cancelled")(REQUESTS)
        assert cut == 1, "the stalled client was never cut"
        # the client, still connected, reads nothing: only the proxy can end its socket
        gone = until(lambda: not proxy_sockets(int(port), client_port), 5.0)
        left = proxy_sockets(int(port), client_port)
    assert gone, f"the proxy's socket to the cut client: {left} ({_FIN_WAIT1}: FIN-WAIT-1)"
