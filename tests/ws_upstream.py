"""A real WebSocket upstream on loopback: the `websockets` library's server in a thread.

It echoes every message as it came (text as text, binary as binary), with permessage-deflate
on (the library's default) and the subprotocol `chat.v1` when a client offers it, and records what each session saw: the handshake's request
headers, the messages it received, the close frame the client sent, and when its side of
the connection ended. A few texts ask for more:

- `fragments`: answer with one text message in three frames (`frag-`, `ment-`, `ed`);
- `close CODE REASON`: close the session with that code and reason;
- `silence`: stop answering (the session stays open until the client leaves).

`/refuse` answers the upgrade with 403 and a body, as an auth check would. `python -m
tests.ws_upstream PORT` runs it alone (the benchmark's WebSocket echo upstream).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from websockets.asyncio.server import Server, ServerConnection, serve, unix_serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from tests.servers import WsLoopThread

REFUSAL_BODY = b'{"error": "no entry for you"}\n'


@dataclass
class Session:
    path: str
    headers: list[tuple[str, str]]
    received: list[str | bytes] = field(default_factory=list)
    close_code: int | None = None  # the close frame the client sent, if any
    close_reason: str | None = None
    ended_at: float | None = None  # time.monotonic() when the server saw the end
    done: threading.Event = field(default_factory=threading.Event)


async def _handler(ws: ServerConnection, sessions: list[Session] | None) -> None:
    request = ws.request
    assert request is not None
    session = Session(request.path, list(request.headers.raw_items()))
    if sessions is not None:
        sessions.append(session)
    try:
        async for message in ws:
            if sessions is not None:
                session.received.append(message)
            if message == "fragments":
                await ws.send(iter(["frag-", "ment-", "ed"]))
            elif isinstance(message, str) and message.startswith("close "):
                _, code, reason = message.split(" ", 2)
                await ws.close(int(code), reason)
            elif message == "silence":
                await ws.wait_closed()
            else:
                await ws.send(message)
    except ConnectionClosed:
        pass
    finally:
        await ws.wait_closed()
        session.ended_at = time.monotonic()
        rcvd = ws.protocol.close_rcvd
        if rcvd is not None:
            session.close_code = rcvd.code
            session.close_reason = rcvd.reason
        session.done.set()


def _subprotocol(connection: ServerConnection, offered: Sequence[str]) -> str | None:
    """`chat.v1` when the client offers it; no subprotocol otherwise."""
    return "chat.v1" if "chat.v1" in offered else None


def _refuse(connection: ServerConnection, request: Request) -> Response | None:
    if request.path == "/refuse":
        response = connection.respond(HTTPStatus.FORBIDDEN, "")
        response.headers = Headers({"Content-Type": "application/json", "X-Refused-By": "test"})
        response.headers["Content-Length"] = str(len(REFUSAL_BODY))
        response.body = REFUSAL_BODY
        return response
    return None


class EchoUpstream(WsLoopThread):
    """The echo server on 127.0.0.1:<free port> with its own event loop in a daemon thread.

    `record=False` keeps nothing (a benchmark's long run); `options` go to `serve`."""

    what = "the WebSocket echo upstream"

    def __init__(self, record: bool = True, uds: str | None = None, **options: Any) -> None:
        super().__init__()
        self.uds = uds  # listen on this Unix socket instead (tests/server/test_unix_sockets.py)
        self.record = record
        self.sessions: list[Session] = []
        self.options = {"max_size": 8 * 1024 * 1024, **options}
        self._server: Server | None = None

    async def _serve(self) -> None:
        handler = lambda ws: _handler(ws, self.sessions if self.record else None)  # noqa: E731
        options: dict[str, Any] = {
            "process_request": _refuse,
            "select_subprotocol": _subprotocol,
            **self.options,
        }
        server_of = (
            serve(handler, "127.0.0.1", self.port, **options)
            if self.uds is None
            else unix_serve(handler, self.uds, **options)
        )
        async with server_of as server:
            self._server = server
            self._ready.set()
            await server.serve_forever()

    def stop(self) -> None:
        if self.loop is not None and self._server is not None:
            self.loop.call_soon_threadsafe(self._server.close)
        self._thread.join(timeout=10)

    def wait_sessions(self, n: int, since: int = 0, timeout: float = 10.0) -> list[Session]:
        """Sessions since..since+n, once each has ended (`since`: len(sessions) before)."""
        deadline = time.monotonic() + timeout
        while len(self.sessions) < since + n:
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(self.sessions) - since} sessions, expected {n}")
            time.sleep(0.005)
        chosen = self.sessions[since : since + n]
        for session in chosen:
            if not session.done.wait(max(0.0, deadline - time.monotonic())):
                raise AssertionError(f"session {session.path} did not end")
        return chosen


def main(argv: list[str]) -> int:
    upstream = EchoUpstream(record=False)
    upstream.port = int(argv[0]) if argv and int(argv[0]) else upstream.port
    upstream.start()
    print(f"WebSocket echo upstream on {upstream.url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        upstream.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
