"""What the record says of a failed connect, and what the client is told, the same for
each client the data paths connect with: the wire's pool (proxy/server/dial.py) and the
ASGI relay's `send_upstream` on its aiohttp and httpx transports. The record names the
address tried, and for a timeout the setting; the client's answer leaves the address out.

Each connects for real, on 127.0.0.1: to a closed port (refused), and to a listener whose
backlog is full (its SYNs dropped, so the connect times out).
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from collections.abc import Iterator

import pytest

from proxy.core.errors import Cause, describe, relay_failure
from proxy.core.upstream_url import UpstreamURL
from proxy.server.upstream import create_client, send_upstream
from proxy.server.wire.upstream import Pool
from proxy.settings import Settings
from tests.backlog import full_backlog
from tests.server.conftest import no_proxy

# Each test is parametrized over the three clients itself, and starts no proxy.
pytestmark = no_proxy

LIMIT = 0.3


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def not_accepting() -> Iterator[int]:
    """A port whose listener takes no more connections: the next SYN goes unanswered."""
    with full_backlog(("127.0.0.1", 0)) as (_, port):
        yield int(port)


async def _connect(client: str, port: int) -> BaseException:
    upstream = f"http://127.0.0.1:{port}"
    if client == "wire":
        pool = Pool(UpstreamURL.parse(upstream), LIMIT)
        with pytest.raises(Exception) as raised:
            await pool.connect()
        return raised.value
    settings = dataclasses.replace(
        Settings(upstream=upstream), upstream_transport=client, connect_timeout=LIMIT
    )
    async with create_client(settings) as http:
        with pytest.raises(Exception) as raised:
            await send_upstream(http, "GET", upstream + "/v1/models", [(b"host", b"x")], b"")
    return raised.value


def told(exc: BaseException) -> tuple[str, str]:
    """The record's message and the client's, for `exc` before any response head."""
    failure = relay_failure(Cause.UPSTREAM_BROKE, after_headers=False, exc=exc)
    assert failure.answer is not None
    return failure.message, failure.answer[2]


CLIENTS = ["wire", "aiohttp", "httpx"]


@pytest.mark.parametrize("client", CLIENTS)
def test_a_refused_connect_is_recorded_with_the_address_tried(client: str) -> None:
    """The record said what the event loop said: asyncio's "Connect call failed
    ('127.0.0.1', port)" here, uvloop's "Connection refused" (the wire's, in `tokenprobe
    serve`) with no address, httpcore's the same."""
    port = closed_port()
    exc = asyncio.run(_connect(client, port))
    record, answer = told(exc)
    words = "ConnectionRefusedError: [Errno 111] Connection refused"
    assert record == f"{words} to host 127.0.0.1:{port}"
    assert answer == f"upstream: {words}"
    assert describe(exc) == record


@pytest.mark.parametrize("client", CLIENTS)
def test_a_connect_timeout_is_recorded_with_the_setting_and_the_address(
    client: str, not_accepting: int
) -> None:
    """Each said "CancelledError: ...", of a task cancelled, whatever ran out."""
    exc = asyncio.run(_connect(client, not_accepting))
    assert isinstance(exc, TimeoutError)
    record, answer = told(exc)
    words = "ConnectTimedOut: the connect timed out after 0.3 s (--connect-timeout)"
    assert record == f"{words} to host 127.0.0.1:{not_accepting}"
    assert answer == f"upstream: {words}"
