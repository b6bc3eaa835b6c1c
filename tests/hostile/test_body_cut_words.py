"""A response body the upstream cut short with a clean close is told in the wire's words on
every data path: "UpstreamClosed: the upstream closed the connection before the end of
the response body" (proxy.core.errors.UPSTREAM_FAULTS, closed_early).

The ASGI relay's aiohttp transport told it in its parser's: "ContentLengthError: 400,
message: Not enough data to satisfy content length header." (TransferEncodingError for a
chunked body), where 400 is aiohttp's internal code for every parser error, no status
any peer sent; and a reset in the same words, where the wire and httpx say the system's
("ConnectionResetError: [Errno 104] Connection reset by peer"), or for a body framed by
the close as "ClientPayloadError: response body cut short: ConnectionResetError(104, ...)";
and a chunk size that is not hex with the same "400, message:" before llhttp's reason,
which the wire gives as "UpstreamProtocolError: malformed response: <reason>".

Each test runs on the three paths (the `path` fixture), in a real `tokenprobe serve` for
the module and path, whose access log (stdout) is the record read, in front of a
RawUpstream.
Shown able to fail: each was run against the tree before.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.edge_backend import serving_process
from tests.hostile.peers import Conn, Handler, RawUpstream, Request, by_target
from tests.hostile.shared import DataPath, until

RESET = "ConnectionResetError: [Errno 104] Connection reset by peer"
CLOSED = "UpstreamClosed: the upstream closed the connection before the end of the response body"

CUT_SHORT = {
    "content-length": b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
    b"content-length: 100\r\n\r\n0123456789",
    "chunked": b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
    b"transfer-encoding: chunked\r\n\r\na\r\n0123456789\r\n",
}


def answer_and_close(response: bytes) -> Handler:
    """A handler writing `response`, then closing the connection cleanly (a FIN)."""

    async def handler(conn: Conn, request: Request) -> None:
        conn.write(response)
        await conn.drain()
        conn.writer.close()

    return handler


class LoggedProxies:
    """One `tokenprobe serve` per data path for the module, each writing its JSON access
    log (stdout) to a file of its own: a test reads the record its request added."""

    def __init__(self, stack: contextlib.ExitStack, logs: Path) -> None:
        self._stack, self._logs = stack, logs
        self._running: dict[str, tuple[str, Path]] = {}

    def take(self, path: DataPath, upstream: str) -> tuple[str, Path]:
        """(the proxy's base URL, its access log) on `path` (whose fixture set
        TOKENPROBE_RELAY) in front of `upstream`."""
        if path.name not in self._running:
            log = self._logs / f"access-{path.name}.jsonl"
            self._running[path.name] = (
                self._stack.enter_context(_logged(path, upstream, log)),
                log,
            )
        return self._running[path.name]


@contextlib.contextmanager
def _logged(path: DataPath, upstream: str, log: Path) -> Iterator[str]:
    with (
        log.open("wb") as out,
        serving_process(upstream, "--access-log", "json", *path.flags, stdout=out.fileno()) as (
            b,
            _,
        ),
    ):
        yield b


@pytest.fixture(scope="module")
def logged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoggedProxies]:
    with contextlib.ExitStack() as stack:
        yield LoggedProxies(stack, tmp_path_factory.mktemp("access-logs"))


def one_record(logged: LoggedProxies, path: DataPath, upstream: str) -> dict[str, Any]:
    """The record of one measured request that the upstream's handler cuts short."""
    base, log = logged.take(path, upstream)
    before = len(records(log))
    with contextlib.suppress(httpx.HTTPError):  # the proxy drops the client: cut short
        httpx.post(base + "/v1/completions", json={"model": "m", "prompt": "hi"}, timeout=30)
    assert until(lambda: len(records(log)) == before + 1)
    return records(log)[-1]


def records(log: Path) -> list[dict[str, Any]]:
    lines = log.read_bytes().splitlines()
    return [record for line in lines if b'"endpoint"' in line for record in [orjson.loads(line)]]


@pytest.mark.parametrize("framing", CUT_SHORT)
def test_a_body_cut_by_a_clean_close_is_told_in_the_wires_words(
    upstream: RawUpstream,
    path: DataPath,
    framing: str,
    logged: LoggedProxies,
) -> None:
    upstream.default = by_target({b"/v1/completions": answer_and_close(CUT_SHORT[framing])})
    record = one_record(logged, path, upstream.url)
    assert (record["error_type"], record["error"]) == ("stream_truncated", CLOSED)


def answer_and_reset(response: bytes) -> Handler:
    """A handler writing `response`, then resetting the connection (SO_LINGER 0, an RST)."""

    async def handler(conn: Conn, request: Request) -> None:
        conn.write(response)
        await conn.drain()
        await asyncio.sleep(0.2)  # the head and the first bytes through, then the reset
        sock = conn.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.writer.transport.abort()

    return handler


#: A body framed by the connection's close: a reset cuts it short (RFC 9112 §8).
TO_CLOSE = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n0123456789"


@pytest.mark.parametrize("framing", [*CUT_SHORT, "to-close"])
def test_a_body_cut_by_a_reset_is_told_in_the_systems_words(
    upstream: RawUpstream, path: DataPath, framing: str, logged: LoggedProxies
) -> None:
    response = CUT_SHORT.get(framing, TO_CLOSE)
    upstream.default = by_target({b"/v1/completions": answer_and_reset(response)})
    record = one_record(logged, path, upstream.url)
    assert (record["error_type"], record["error"]) == ("stream_truncated", RESET)


def answer_then_bad_chunk(head: bytes) -> Handler:
    """A handler writing a chunked head and a first chunk, then (once through) a chunk
    size that is not hex, and closing."""

    async def handler(conn: Conn, request: Request) -> None:
        conn.write(head)
        await conn.drain()
        await asyncio.sleep(0.2)
        conn.write(b"zz\r\nxx\r\n")
        await conn.drain()
        await asyncio.sleep(0.2)
        conn.writer.close()

    return handler


def test_a_malformed_chunk_mid_body_is_told_in_the_wires_words(
    upstream: RawUpstream,
    path: DataPath,
    logged: LoggedProxies,
    request: pytest.FixtureRequest,
) -> None:
    """aiohttp's: "ClientPayloadError: malformed response body: 400, message: Invalid
    character in chunk size: b'zz' ^"."""
    if path.name == "asgi-httpx":
        reason = "the httpx transport tells it in h11's words (illegal chunk header)"
        request.applymarker(pytest.mark.xfail(reason=reason, strict=True))
    upstream.default = by_target({b"/v1/completions": answer_then_bad_chunk(CUT_SHORT["chunked"])})
    record = one_record(logged, path, upstream.url)
    said = "UpstreamProtocolError: malformed response: Invalid character in chunk size"
    assert (record["error_type"], record["error"]) == ("stream_truncated", said)
