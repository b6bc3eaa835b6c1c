"""A WebSocket handshake the proxy answered itself, because its upstream failed before
any byte of an answer: the session's record says what the client was told (the outcome
agrees with the answer's error kind) and why, in the HTTP record's words for the same
fault, the address the connect tried included (proxy.core.errors.relay_failure)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import orjson
import pytest

from proxy.core.wsrecord import WsSessionRecord
from tests.backlog import full_backlog
from tests.hostile.client import responses, ws_head
from tests.hostile.peers import exchange
from tests.server.conftest import paths
from tests.ws_proxy import TunnelListener

pytestmark = paths("wire", why="only the wire tunnels WebSockets")


@pytest.fixture
def unanswered() -> Iterator[str]:
    """An upstream on 127.0.0.1 whose SYNs go unanswered: a listener with a full
    backlog, so a connect waits for --connect-timeout."""
    with full_backlog(("127.0.0.1", 0)) as (host, port):
        yield f"http://{host}:{port}"


def _ended(listener: TunnelListener, timeout: float = 5.0) -> WsSessionRecord:
    deadline = time.monotonic() + timeout
    while not listener.recorder.sessions:
        assert time.monotonic() < deadline, "no session ended"
        time.sleep(0.01)
    (record,) = listener.recorder.sessions
    return record


def test_a_handshakes_connect_timeout_is_recorded_as_the_client_was_told(
    unanswered: str,
) -> None:
    """The client got 504 upstream_timeout, and the session's record said
    upstream_unreachable with no word of why or where."""
    listener = TunnelListener(unanswered, connect_timeout=0.5).start()
    try:
        got = exchange(f"http://127.0.0.1:{listener.port}", ws_head(), idle=3.0, total=5.0)
        ((status, _, body),) = responses(got)
        told = orjson.loads(body)["error"]
        record = _ended(listener)
    finally:
        listener.stop()
    assert (status, told["type"]) == (504, "upstream_timeout"), got
    assert (record.status, record.outcome) == (504, "upstream_timeout"), record
    where = unanswered.removeprefix("http://")
    assert record.error == (
        f"ConnectTimedOut: the connect timed out after 0.5 s (--connect-timeout) to host {where}"
    )
    assert where not in told["message"]
