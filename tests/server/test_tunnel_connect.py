"""A WebSocket handshake whose upstream connect fails gets what an HTTP request gets from
the same proxy: the same status and error kind (proxy.core.errors.relay_failure), whatever
the connect raised, not only an OSError or a timeout."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import orjson
import pytest

from tests.conftest import ProxyUnderTest
from tests.hostile.client import responses, ws_head
from tests.hostile.peers import exchange
from tests.server.conftest import paths
from tests.ws_proxy import TunnelListener

pytestmark = paths("wire", why="only the wire tunnels WebSockets")

#: A host whose first DNS label is over 63 characters: the connect raises UnicodeError
#: (getaddrinfo's idna codec, "label empty or too long"), a ValueError, before any socket.
LONG_LABEL = "http://" + "a" * 64 + ".test:8000"


def _kind(body: bytes) -> str:
    return str(orjson.loads(body)["error"]["type"])


@pytest.fixture
def listener() -> Iterator[TunnelListener]:
    started = TunnelListener(LONG_LABEL).start()
    yield started
    started.stop()


def _wait(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_connect_that_raises_a_value_error_gets_the_http_relays_502(
    start_proxy: Callable[..., ProxyUnderTest], listener: TunnelListener
) -> None:
    """The tunnel once caught only OSError and TimeoutError: the UnicodeError escaped its
    connect task (a traceback in the log), and the client heard nothing until
    --first-byte-timeout's 504, where an HTTP request got a 502 at once."""
    proxy = start_proxy(LONG_LABEL)
    http = exchange(
        proxy.url,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\ncontent-length: 2\r\n\r\n{}",
        idle=1.0,
    )
    ((status, _, body),) = responses(http)
    assert status == 502, http
    kind = _kind(body)
    for base in (proxy.url, f"http://127.0.0.1:{listener.port}"):
        got = exchange(base, ws_head(), idle=3.0, total=5.0)
        ((ws_status, _, ws_body),) = responses(got)
        assert (ws_status, _kind(ws_body)) == (502, kind), got
    _wait(lambda: listener.open_tunnels() == 0)
    sessions = "tokenprobe_websocket_sessions_total"
    assert listener.sample(sessions, route="/v1/realtime", outcome="upstream_unreachable") == 1
