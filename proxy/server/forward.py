"""The ASGI relay: one request upstream through httpx and its response back, byte for byte.

The data path of `tokenprobe serve --relay asgi` and of the ASGI app (`proxy.asgi:app`)
under any ASGI server. `Forwarder` is the ASGI endpoint: admission (proxy/server/admission.py)
reads and checks the request, then a `Relay`, one per request, runs `send_request`
(upstream request, response head), `stream` (the per-chunk loop), `fail` (an early end ->
the proxy's answer) and the exchange's one finish sequence. What is measured, how, and
what an early end means belong to the shared exchange (proxy/server/exchange.py); the
wire (proxy/server/wire/) drives the same one.

Each chunk goes to the client first; only then does the exchange see it, with the time of
the network read. A client that goes away (seen on `receive()`, because a send to a gone
client can succeed silently) cancels the upstream request at once, so the backend aborts
the generation and frees its KV cache.
"""

from __future__ import annotations

import asyncio
import logging
from time import perf_counter, time
from typing import Any

import httpx

from proxy.core.errors import Cause, Failure
from proxy.core.measurement import ErrorType
from proxy.core.strip import UsageEventStripper
from proxy.core.tokens import TokenCounter
from proxy.core.upstream_url import UpstreamURL
from proxy.server.admission import (
    BODY_TIMEOUT,
    ClientGone,
    Refused,
    RelaySettings,
    admit,
    body_too_large,
    check_head,
    count_refusal,
    error_answer,
    measured_api,
    relay_settings,
    target,
)
from proxy.server.exchange import Context, IdleTimer, MeasuredExchange
from proxy.server.headers import client_headers
from proxy.server.upstream import UpstreamProtocolError, body_reader, send_upstream
from proxy.settings import Settings
from proxy.sinks.dispatch import Sinks
from proxy.types import Receive, Scope, Send

log = logging.getLogger("tokenprobe")


class UpstreamBroke(Exception):
    """Raised to the server after relaying a partial body, so it drops the client's
    connection instead of ending the body cleanly: the client sees the break, as it
    would have without the proxy."""


class Forwarder:
    """The ASGI relay's endpoint: shared by all requests, holding no request's state."""

    def __init__(
        self,
        *,
        client: httpx.AsyncClient,
        sinks: Sinks,
        counter: TokenCounter | None,
        settings: RelaySettings,
    ) -> None:
        self.client = client
        self.context = Context(sinks, counter, settings)
        settings.injection.on_refuse = sinks.usage_injection_refused
        self.upstream = UpstreamURL.parse(settings.upstream)
        self.origin = self.upstream.origin

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        *,
        client: httpx.AsyncClient,
        sinks: Sinks,
        counter: TokenCounter | None,
    ) -> Forwarder:
        return cls(client=client, sinks=sinks, counter=counter, settings=relay_settings(settings))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = perf_counter()
        started_at = time()
        sinks, limits = self.context.sinks, self.context.settings
        path: str = scope["path"]
        api = None
        try:
            where = target(scope.get("raw_path") or path.encode(), scope["query_string"])
            path = where.path
            api = measured_api(scope["method"], path)
            check_head(scope["headers"], limits)
            body = await _read_body(receive, limits)
        except Refused as refusal:
            await _send_answer(send, refusal.status, refusal.kind, refusal.message, path)
            count_refusal(sinks, path, api, refusal.status, start, started_at)
            return
        except ClientGone:
            count_refusal(sinks, path, api, 0, start, started_at, ErrorType.CLIENT_CANCELLED)
            return
        scope = {**scope, "path": path, "query_string": where.query.encode()}
        read = perf_counter()  # the request is in: the proxy's own time starts (overhead)
        info, stripper = None, None
        if api is not None:
            info, body, stripper = admit(api, body, limits, self.context.backend.kind)
        exchange = MeasuredExchange(
            self.context, path, scope["headers"], info, start, started_at, read
        )
        url = self.origin + self.upstream.target(path, where.query)
        await Relay(self.client, exchange, scope, receive, send).run(url, body, stripper)


async def _read_body(receive: Receive, limits: RelaySettings) -> bytes:
    """The whole request body, or `Refused` (413, 408) or `ClientGone`."""
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(limits.body_timeout):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limits.max_body_bytes:
                    raise body_too_large(limits.max_body_bytes)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    except TimeoutError:
        raise BODY_TIMEOUT from None


class Relay:
    """One request relayed upstream and its response back: `run` is the whole life.

    Three things may cancel the task running a relay: the client leaving
    (`_watch_client`), the idle timer, and the server when its drain time runs out. The
    first two cancel through `cut`, which records their cause, so a cancellation without
    one is the server's.
    """

    __slots__ = ("client", "cut", "exchange", "idle", "receive", "response", "scope", "send")

    def __init__(
        self,
        client: httpx.AsyncClient,
        exchange: MeasuredExchange,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        self.client, self.exchange = client, exchange
        self.scope, self.receive, self.send = scope, receive, send
        task = asyncio.current_task()
        assert task is not None
        self.cut = _CancelOnce(task)
        self.response: httpx.Response | None = None
        self.idle: IdleTimer | None = None

    async def run(self, url: str, body: bytes, stripper: UsageEventStripper | None) -> None:
        cut = self.cut
        watcher = asyncio.create_task(_watch_client(self.receive, cut))
        failure: Failure | None = None
        try:
            stripper = await self.send_request(url, body, stripper)
            await self.stream(stripper)
        except asyncio.CancelledError:
            cut.task.uncancel()
            failure = await self.fail(cut.cause or Cause.SHUTDOWN)
        except Exception as exc:
            failure = await self.fail(cut.cause or Cause.UPSTREAM_BROKE, exc)
        finally:
            cut.done = True
            watcher.cancel()
            if self.idle is not None:
                self.idle.cancel()
            if self.response is not None:
                await self.response.aclose()
        await self.exchange.finish(perf_counter(), failure)
        if failure is not None and failure.drop:
            raise UpstreamBroke(failure.message)

    # -- the steps --------------------------------------------------------------------

    async def send_request(
        self, url: str, body: bytes, stripper: UsageEventStripper | None
    ) -> UsageEventStripper | None:
        """Send the request upstream (to `url`: the upstream's origin and base path, then
        the normalised target) and the response head to the client. Returns the stripper
        if this response is one to strip."""
        scope, exchange = self.scope, self.exchange
        limits = exchange.context.settings
        headers = exchange.upstream_headers()
        exchange.sent(perf_counter())
        try:
            async with asyncio.timeout(limits.first_byte_timeout) as deadline:
                self.response = response = await send_upstream(
                    self.client, scope["method"], url, headers, body
                )
        except TimeoutError:
            if deadline.expired():
                self.cut.cause = Cause.FIRST_BYTE_TIMEOUT
            raise
        status = response.status_code
        if status < 200:  # a 101 the relay never asked for (both clients drop other 1xx)
            exchange.context.sinks.count_upstream_protocol_error("upgrade")
            raise UpstreamProtocolError("upgrade", f"the upstream answered {status} unasked")
        content_type = response.headers.get("content-type", "")
        exchange.open(status, content_type, perf_counter())
        # Only an event stream has a usage event to drop: any other body (a JSON answer
        # to a stream request) passes whole.
        if not (status < 400 and content_type.startswith("text/event-stream")):
            stripper = None
        raw = [(k.lower(), v) for k, v in response.headers.raw]
        out = client_headers(raw, content_type.encode(), body_changes=stripper is not None)
        await self.send({"type": "http.response.start", "status": status, "headers": out})
        exchange.relayed(perf_counter())
        return stripper

    async def stream(self, stripper: UsageEventStripper | None) -> None:
        """The per-chunk loop: each read goes to the client, then to the exchange. It
        runs for every chunk of every stream; add nothing here that could run once."""
        assert self.response is not None
        send, exchange = self.send, self.exchange
        strip = None if stripper is None else stripper.feed
        feed = exchange.feed
        read = body_reader(self.response)
        idle = self.idle = IdleTimer(exchange.context.settings.idle_timeout, self.cut)
        while True:
            idle.waiting = perf_counter()
            chunk = await read()
            idle.waiting = None
            if not chunk:
                break
            now = perf_counter()
            out = chunk if strip is None else strip(chunk)
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
            feed(chunk, now)
        if stripper is not None and (rest := stripper.flush()):
            await send({"type": "http.response.body", "body": rest, "more_body": True})
        self.cut.done = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        exchange.end_of_stream(perf_counter())

    async def fail(self, cause: Cause, exc: BaseException | None = None) -> Failure:
        """The relay stopped early; a client that has no response head yet gets the
        proxy's own error answer."""
        self.cut.done = True
        exchange = self.exchange
        failure = exchange.failure(cause, exc)
        if failure.answer is not None:
            exchange.status, kind, message = failure.answer
            await _send_answer(self.send, exchange.status, kind, message, exchange.path)
        return failure


class _CancelOnce:
    """Cancels a relay's task once, recording why. The client watcher and the idle timer
    hold this, not the relay, so a pending one never keeps the relay's buffers alive."""

    __slots__ = ("cause", "done", "task")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.cause: Cause | None = None  # None after a cancellation: the server's
        self.done = False  # the response is over: a client leaving now changes nothing

    def __call__(self, cause: Cause) -> None:
        if self.cause is None and not self.done:
            self.cause = cause
            self.task.cancel()


async def _watch_client(receive: Receive, cut: _CancelOnce) -> None:
    # A send to a gone client can succeed silently: only receive() tells.
    while (await receive())["type"] != "http.disconnect":
        pass
    cut(Cause.CLIENT_GONE)


async def _send_answer(send: Send, status: int, kind: str, message: str, path: str) -> None:
    headers, body = error_answer(status, kind, message, path)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


__all__ = ["Forwarder", "UpstreamBroke"]
