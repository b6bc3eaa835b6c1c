"""One HTTP exchange on raw ASGI: read the body, write the response, notice the client go.

It keeps the request's `SimRequest` up to date as bytes go out. Per-connection state
lives here, never in the app.

Why a watcher task: under uvicorn a `send` to a client that has gone away returns
silently, so a generator that only writes would never learn it should stop. The
watcher waits on `receive()` for `http.disconnect` and cancels the handler at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Sequence

from starlette.types import Receive, Send

from proxy.sim.errors import ErrorReply
from proxy.sim.state import Outcome, SimRequest, SimState


class Exchange:
    __slots__ = (
        "_hash",
        "_receive",
        "_send",
        "_state",
        "complete",
        "disconnected",
        "finished",
        "record",
    )

    def __init__(
        self, receive: Receive, send: Send, record: SimRequest, state: SimState, hash_body: bool
    ):
        self._receive = receive
        self._send = send
        self._state = state
        self.record = record
        self._hash = hashlib.sha256() if hash_body else None
        self.complete = False  # the last body byte was handed to the server
        self.disconnected = False
        self.finished = False  # the record is final

    async def read_body(self) -> bytes | None:
        """The whole request body, or None if the client left before sending it."""
        parts = []
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                return None
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(parts)

    async def guard(self, handler: Callable[[], Awaitable[Outcome]]) -> Outcome:
        """Run `handler`, cancelling it the moment the client disconnects."""
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.create_task(self._watch(task))
        try:
            return await handler()
        except asyncio.CancelledError:
            if not self.disconnected:
                raise  # the server is shutting down, not our client leaving
            task.uncancel()
            return "aborted"
        finally:
            watcher.cancel()

    async def _watch(self, task: asyncio.Task[object]) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                # After the response completes, uvicorn reports a disconnect at once.
                if not self.complete:
                    self.disconnected = True
                    self.record.aborted_at = time.monotonic()
                    task.cancel()
                return

    async def start(
        self, status: int, content_type: bytes, extra: Sequence[tuple[bytes, bytes]] = ()
    ) -> None:
        headers = [(b"content-type", content_type), *extra] if content_type else [*extra]
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        self.record.status = status
        self.record.first_byte_at = time.monotonic()

    async def write(self, data: bytes) -> None:
        record = self.record
        record.chunks_sent += 1
        record.bytes_sent += len(data)
        if self._hash is not None:
            self._hash.update(data)
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self, data: bytes = b"", outcome: Outcome = "completed") -> None:
        """Send the last body bytes (if any) and finish the response cleanly."""
        self.complete = True
        if data:
            record = self.record
            record.chunks_sent += 1
            record.bytes_sent += len(data)
            if self._hash is not None:
                self._hash.update(data)
        # The record is final before the client can see the end of the body, so a test
        # that has read the whole response may read the record without waiting.
        self.finish(outcome)
        await self._send({"type": "http.response.body", "body": data, "more_body": False})

    def finish(self, outcome: Outcome) -> None:
        """Make the record final (once): digest, outcome, finished_at, `active` count."""
        if self.finished:
            return
        self.finished = True
        if self._hash is not None:
            self.record.body_sha256 = self._hash.hexdigest()
        self._state.end(self.record, outcome)

    async def reply(
        self,
        status: int,
        body: bytes,
        content_type: bytes = b"application/json",
        extra: Sequence[tuple[bytes, bytes]] = (),
        outcome: Outcome = "completed",
    ) -> None:
        """A whole response at once, with a content-length."""
        length = (b"content-length", b"%d" % len(body))
        await self.start(status, content_type, (length, *extra))
        await self.end(body, outcome)

    async def error(self, reply: ErrorReply) -> None:
        await self.reply(reply.status, reply.body, reply.content_type, reply.headers, "error")
