"""A request given up on while its body still goes upstream: the backend learns at once,
on every path (the wire, the ASGI relay on aiohttp and on httpx), though it has read
none of the body.

A backend reads a large body slowly when it is busy or far away; vLLM cancels a request
whose client is gone only once it hears of it (uvicorn's `http.disconnect`, which vLLM
0.32 listens for: vllm/entrypoints/serve/utils/api_utils.py `with_cancellation`,
`listen_for_disconnect`). Before: the wire stopped reading a client while its body went
up, so the client's close went unseen until the backend had read it all (16 MiB at
256 KB/s: 75 s); and every path, giving up on the upstream connection, closed it the
graceful way, which sends the rest of the body first and the FIN behind it: a backend
that reads nothing kept the connection for good (a `--first-byte-timeout` 504 left it
ESTABLISHED with about 4 MB queued). Now the connection is reset (SO_LINGER 0), so the
backend's kernel knows at once. The backend here reads a request's head and no byte of
its body, and the tests read its socket's TCP state: CLOSE after a reset, CLOSE-WAIT
after a FIN (which could only come once the body were read).

Shown able to fail: each test failed on the tree before the fix, on each path.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest

from tests.hostile.peers import get
from tests.hostile.shared import DataPath, counted, counted_when, until
from tests.scrape import REQUESTS
from tests.servers import accept_each

pytestmark = pytest.mark.skipif(
    not hasattr(socket, "TCP_INFO"), reason="reads the backend's TCP state (TCP_INFO: Linux)"
)

UPLOAD = b"/v1/chat/completions"
CLOSED = "tokenprobe_connections_closed_total"
#: Far more than the backend's receive buffer (64 KiB) and the proxy's send queue (about
#: 4 MB on loopback) hold together, and well under --max-body-bytes (32 MiB).
BODY = 8 * 2**20
_ESTABLISHED, _CLOSE, _CLOSE_WAIT = 1, 7, 8
#: How soon the backend must learn of it: at once, but for a loaded 2-core machine (before
#: the fix: never, or after the whole body was read).
SOON = 5.0


class HeadOnly:
    """A backend that reads each upload's head and none of its body, holding the
    connection open; anything else gets a 404. `held` are the held connections."""

    def __init__(self) -> None:
        self.held: list[socket.socket] = []
        self._done = threading.Event()
        self._listener = accept_each(self._serve, 16)
        # inherited by each connection accepted: the body stays in the proxy's buffers
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2**16)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                piece = conn.recv(4096)
                if not piece:
                    return
                head += piece
            if not head.startswith(b"POST " + UPLOAD + b" "):
                conn.sendall(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                return
            self.held.append(conn)
            self._done.wait(60)

    def state(self) -> int:
        """The TCP state of the upload's connection, as the backend's kernel has it."""
        return self.held[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]

    def told_within(self, seconds: float) -> bool:
        """Whether the backend's kernel knows the proxy ended the connection (a reset, or
        a FIN) within `seconds`."""
        return until(lambda: self.state() in (_CLOSE, _CLOSE_WAIT), seconds)

    def close(self) -> None:
        self._done.set()
        self._listener.close()


@pytest.fixture
def backend() -> Iterator[HeadOnly]:
    peer = HeadOnly()
    try:
        yield peer
    finally:
        peer.close()


def upload() -> bytes:
    """A streaming chat request whose body is BODY bytes."""
    text = b"a" * (BODY - 100)
    body = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"%s"}]}' % text
    return (
        b"POST %s HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (UPLOAD, len(body), body)
    )


@contextlib.contextmanager
def sending(base: str, data: bytes) -> Iterator[socket.socket]:
    """A client connection that has sent `data` whole (into the sockets' buffers)."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(data)
        yield sock


def test_a_client_that_leaves_while_its_body_goes_up_has_the_backend_told_at_once(
    backend: HeadOnly, path: DataPath
) -> None:
    """The client leaves once the backend has the head; the backend, which has read
    none of the body, learns within seconds, and the request is client_cancelled."""
    with path.proxy(backend.url) as base:
        with sending(base, upload()):
            assert until(lambda: bool(backend.held), 10), "the upload never reached the backend"
            assert backend.state() == _ESTABLISHED
        assert backend.told_within(SOON), f"the backend's connection: state {backend.state()}"
        cancelled = counted_when(base, REQUESTS, 1, error_type="client_cancelled")(REQUESTS)
    assert cancelled == 1


def test_a_first_byte_timeout_while_the_body_goes_up_has_the_backend_told_at_once(
    backend: HeadOnly, path: DataPath
) -> None:
    """The client gets its 504 at --first-byte-timeout; the backend, which has read none
    of the body, learns within seconds of it."""
    flags = (*path.flags, "--first-byte-timeout", "1")
    with (
        path.shared.take(path.relay, backend.url, *flags) as base,
        sending(base, upload()) as sock,
    ):
        answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 504 "), answer[:200]
        assert backend.held, "the upload never reached the backend"
        told = backend.told_within(SOON)  # the client still there: only the 504 ended it
    assert told, f"the backend's connection: state {backend.state()} {SOON} s after the 504"


def test_a_flood_pipelined_behind_an_upload_is_parsed_to_the_bound_and_the_leave_seen(
    backend: HeadOnly, path: DataPath
) -> None:
    """The client is read on while its body goes up, so that its leaving is seen, and
    within the pipelining bound: 3,000 GETs behind the held upload are parsed up to
    MAX_WAITING (the rest read and dropped), and the client's close then resets the
    upload at once."""
    flood = b"".join(get(b"/v1/n/%d" % i) for i in range(3000))
    with path.proxy(backend.url) as base:
        with sending(base, upload() + flood):
            assert until(lambda: bool(backend.held), 10), "the upload never reached the backend"
            stopped = until(lambda: counted(base, CLOSED, reason="too_many_pipelined") == 1, 10)
        told = backend.told_within(SOON)
    assert stopped, "the flood behind the upload was not stopped at the bound"
    assert told, f"the backend's connection: state {backend.state()}"
