"""What the access log says when the upstream ends a response body early: a clean close (a
FIN) is a close, a reset (an RST) is a reset, on both data paths. The error kind is
stream_truncated either way; only the words differ, and an operator reads them to tell a
backend that hung up from one whose connection broke.

The ASGI relay runs on httpx's own transport here; aiohttp's (the default) is told in the
same words since its payload errors are named by their cause
(tests/hostile/test_body_cut_words.py).
"""

from __future__ import annotations

import contextlib
import io
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from proxy.sinks.logs import AccessLog
from tests.conftest import MODEL, ProxyUnderTest
from tests.servers import read_request

CHAT = "/v1/chat/completions"
REQUEST = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
#: The head and the first 10 bytes of a body that promises more.
CUT_SHORT = {
    "content-length": b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
    b"content-length: 100\r\n\r\n0123456789",
    "chunked": b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
    b"transfer-encoding: chunked\r\n\r\na\r\n0123456789\r\n",
}


class CutShort:
    """A raw-socket backend on 127.0.0.1: to its one request it sends `answer`, then, once
    the test has the bytes through the proxy (`cut`), closes the connection cleanly or, with
    SO_LINGER 0, resets it."""

    def __init__(self, answer: bytes, *, reset: bool) -> None:
        self.answer, self.reset = answer, reset
        self.cut = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.settimeout(10)
            request = read_request(conn)
            assert request is not None
            conn.sendall(self.answer)
            self.cut.wait(10)
            if self.reset:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    def stop(self) -> None:
        self.cut.set()
        self.thread.join(10)
        self.listener.close()


@pytest.fixture
def logged(start_proxy: Callable[..., ProxyUnderTest]) -> Iterator[Callable[..., dict[str, Any]]]:
    """`logged(answer, reset=...)`: the access log's JSON line for one request to a backend
    that sends `answer` and then closes or resets the connection."""
    backends: list[CutShort] = []

    def run(answer: bytes, *, reset: bool) -> dict[str, Any]:
        backend = CutShort(answer, reset=reset)
        backends.append(backend)
        log = io.StringIO()
        proxy = start_proxy(
            backend.url, sinks=[AccessLog("json", stream=log)], upstream_transport="httpx"
        )
        with (
            contextlib.suppress(httpx.HTTPError),  # the proxy drops the client: cut short
            httpx.stream("POST", proxy.url + CHAT, json=REQUEST, timeout=10) as response,
        ):
            for piece in response.iter_raw():
                if piece:  # the head and the first bytes came through: now the end
                    backend.cut.set()
        deadline = time.monotonic() + 5
        while not log.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
        record: dict[str, Any] = orjson.loads(log.getvalue().splitlines()[0])
        return record

    yield run
    for backend in backends:
        backend.stop()


@pytest.mark.parametrize("framing", CUT_SHORT)
def test_a_clean_close_mid_body_is_logged_as_a_close_not_a_reset(
    logged: Callable[..., dict[str, Any]], framing: str
) -> None:
    error = logged(CUT_SHORT[framing], reset=False)["error"]
    assert "closed" in error and "reset" not in error.lower(), error


@pytest.mark.parametrize("framing", CUT_SHORT)
def test_a_reset_mid_body_is_logged_as_a_reset(
    logged: Callable[..., dict[str, Any]], framing: str
) -> None:
    error = logged(CUT_SHORT[framing], reset=True)["error"]
    assert "reset" in error.lower(), error
