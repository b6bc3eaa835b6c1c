"""Client-side parts for the hostile-peer suite: WebSocket handshakes written byte for byte,
upstream scripts that switch protocols (or refuse) and note what had arrived by then,
and responses split out of a raw byte stream.

The peers themselves are tests/hostile/peers.py (the lead's kit); this module only adds
what the client-side tests share.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from tests.edge_backend import serving
from tests.hostile.peers import Conn, RawUpstream, Request, Script, ok, raw_upstream

KEY = b"dGhlIHNhbXBsZSBub25jZQ=="  # RFC 6455 §1.3's sample nonce
SWITCH = (
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n"
)
CHAT = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
COMPLETION = (
    b'{"id":"c","object":"chat.completion","model":"m","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"Hello"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}'
)


def close_frame(code: int, reason: bytes, *, masked: bool) -> bytes:
    """A WebSocket close frame (RFC 6455 §5.5.1): a client's is masked, with a zero key so
    that its payload reads as it is."""
    payload = struct.pack("!H", code) + reason
    if masked:
        return bytes((0x88, 0x80 | len(payload))) + b"\0\0\0\0" + payload
    return bytes((0x88, len(payload))) + payload


def ws_head(path: bytes = b"/v1/realtime", *, method: bytes = b"GET", extra: bytes = b"") -> bytes:
    """A well-formed WebSocket upgrade head (RFC 6455 §4.1), `extra` header lines added."""
    return (
        method + b" " + path + b" HTTP/1.1\r\nHost: proxy.example\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Key: " + KEY + b"\r\n"
        b"Sec-WebSocket-Version: 13\r\n" + extra + b"\r\n"
    )


@dataclass
class Switcher:
    """An upstream that answers an upgrade with `answer` (a 101 by default) after `delay`
    seconds, noting which bytes its connection had received at that moment, then reads to
    the end; any other request gets `plain`."""

    answer: bytes = SWITCH
    delay: float = 0.3
    plain: bytes = field(default_factory=ok)
    at_answer: list[bytes] = field(default_factory=list)  # per upgrade, in order

    def script(self) -> Script:
        async def run(conn: Conn) -> None:
            while (request := await conn.read_request()) is not None:
                if not request.header(b"upgrade"):
                    conn.write(self.plain)
                    await conn.drain()
                    continue
                await asyncio.sleep(self.delay)
                self.at_answer.append(bytes(conn.upstream.received[conn.index]))
                conn.write(self.answer)
                await conn.drain()
                while await conn.reader.read(65536):
                    pass
                return

        return run


def responses(data: bytes) -> list[tuple[int, bytes, bytes]]:
    """The responses in a raw byte stream, in order: (status, head, body). A body is
    framed by Content-Length or chunks; a 1xx, 204 or 304 has none; anything else runs
    to the end of `data`."""
    out: list[tuple[int, bytes, bytes]] = []
    rest = data
    for _ in range(64):
        if not rest.startswith(b"HTTP/"):
            break
        head, sep, rest = rest.partition(b"\r\n\r\n")
        if not sep:
            break
        status = int(head.split(b" ", 2)[1])
        request = Request(head, b"")
        length = request.header(b"content-length")
        if status < 200 or status in (204, 304):
            body = b""
        elif length:
            body, rest = rest[: int(length[0])], rest[int(length[0]) :]
        elif b"chunked" in b",".join(request.header(b"transfer-encoding")).lower():
            body, rest = _dechunk(rest)
        else:
            body, rest = rest, b""
        out.append((status, head, body))
        if status == 101:
            break  # what follows is not HTTP
    return out


def whole(count: int = 1, *, bodiless: bool = False) -> Callable[[bytes], bool]:
    """For `exchange(done=...)`: whether a raw byte stream holds `count` whole final
    answers (a 1xx before one is part of it), each framed by its Content-Length or its
    chunks (the last one, and its trailers), or by its head alone where it has no body (a
    101, 204 or 304; every one with `bodiless`, for the answers to HEAD requests). One
    framed otherwise, or not at all (to the close), is never whole: the exchange then
    ends as it would without `done`."""
    return lambda data: _whole_answers(data, bodiless) >= count


def _whole_answers(data: bytes, bodiless: bool) -> int:
    count, at = 0, 0
    while data.startswith(b"HTTP/", at):
        end = data.find(b"\r\n\r\n", at)
        if end < 0:
            return count
        head, at = data[at:end], end + 4
        status = head.split(b" ", 2)[1] if head.count(b" ") else b""
        if not status.isdigit():
            return count
        if 100 <= int(status) < 200 and int(status) != 101:
            continue  # an interim answer: the final one follows
        request = Request(head, b"")
        length = request.header(b"content-length")
        if bodiless or int(status) in (101, 204, 304):
            pass
        elif b"chunked" in b",".join(request.header(b"transfer-encoding")).lower():
            at = _chunks_end(data, at)
        elif len(length) == 1 and length[0].isdigit():
            at += int(length[0])
        else:
            return count  # to the close
        if at < 0 or at > len(data):
            return count
        count += 1
        if int(status) == 101:
            return count  # what follows is not HTTP
    return count


def _chunks_end(data: bytes, at: int) -> int:
    """Where a chunked body starting at `at` ends, its trailers and blank line included;
    -1 while it has not (or is not chunked as RFC 9112 §7.1 says)."""
    while True:
        line_end = data.find(b"\r\n", at)
        size = data[at:line_end].split(b";")[0].strip()
        if line_end < 0 or not size or any(c not in b"0123456789abcdefABCDEF" for c in size):
            return -1
        at = line_end + 2
        if int(size, 16) == 0:
            break
        at += int(size, 16) + 2
        if at > len(data):
            return -1
    while (line_end := data.find(b"\r\n", at)) > at:  # the trailers, to the blank line
        at = line_end + 2
    return at + 2 if line_end == at else -1


def _dechunk(data: bytes) -> tuple[bytes, bytes]:
    body = bytearray()
    rest = data
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            _, _, rest = rest.partition(b"\r\n")
            return bytes(body), rest
        body += rest[:size]
        rest = rest[size + 2 :]


def header_names(head: bytes) -> set[bytes]:
    """The lower-case header names of a raw head."""
    return {line.partition(b":")[0].strip().lower() for line in head.split(b"\r\n")[1:] if line}


@contextlib.contextmanager
def served(relay: str) -> Iterator[tuple[RawUpstream, str]]:
    """A raw upstream and a `tokenprobe serve` on `relay` in front of it, for a module's
    tests that never reach the upstream (each asserts `received_bytes` did not move)."""
    before = os.environ.get("TOKENPROBE_RELAY")
    os.environ["TOKENPROBE_RELAY"] = relay
    try:
        with raw_upstream() as upstream, serving(upstream.url) as base:
            yield upstream, base
    finally:
        if before is None:
            os.environ.pop("TOKENPROBE_RELAY", None)
        else:
            os.environ["TOKENPROBE_RELAY"] = before


def received_bytes(upstream: RawUpstream) -> int:
    """Every byte the upstream has received so far, on all its connections."""
    return sum(len(r) for r in upstream.received)
