"""The hot path: relay one request upstream and its response back, byte for byte.

`Forwarder` is the ASGI endpoint: it reads the request (refusing what is over the limits)
and hands it to a `Relay`, one per request, whose steps are `send_request` (upstream
request, response head), `stream` (the per-chunk loop), `fail` (an early end -> the
record's error and the client's answer, decided by proxy.core.errors.relay_failure) and
`finish` (one record to the sinks).

Each chunk goes to the client first; only then does the observer see it, with the time of
the network read. Which requests are measured, and how, is the API seam's business
(proxy/core/apis): a POST to a path with an Api. Observer failures are caught here, in one
place: the stream carries on unmeasured, the request still ends in one record (status,
e2e, the transport's error type) and a counter says so. A client that goes away (seen on
`receive()`, because a send to a gone client can succeed silently) cancels the upstream
request at once, so the backend aborts the generation and frees its KV cache.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from time import perf_counter, time
from typing import Any

import httpx

from proxy.core.apis import Api, api_for
from proxy.core.errors import Cause, Failure, error_body, error_shape, relay_failure
from proxy.core.labels import SECRET_HEADERS, route_template
from proxy.core.measurement import ErrorType
from proxy.core.observe import StreamObserver, TokenCounts, bare_record
from proxy.core.paths import BadTarget, normalise
from proxy.core.request import RequestInfo, parse_request
from proxy.core.sse import EventTooLarge
from proxy.core.strip import UsageEventStripper
from proxy.core.tokens import TokenCounter
from proxy.server.upstream import body_reader, send_upstream
from proxy.settings import Settings
from proxy.sinks.dispatch import RequestScope, Sinks
from proxy.types import Receive, Scope, Send

log = logging.getLogger("tokenprobe")

_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Expect: the proxy has read the whole body already (the server answered the client's
# 100-continue when it did); passed on, the upstream client would wait for a 100 of its own.
_REQUEST_DROP = _HOP_BY_HOP | {b"host", b"content-length", b"accept-encoding", b"expect"}


@dataclass(frozen=True, slots=True)
class RelaySettings:
    """What the relay reads from the settings, once, at startup (`relay_settings`)."""

    upstream: str  # base URL, no trailing path
    inject_usage: bool  # ask a stream for usage when its client did not, and strip it back
    max_body_bytes: int
    max_header_bytes: int
    max_event_bytes: int
    body_timeout: float  # for the client's request body
    first_byte_timeout: float  # from the upstream request to its response head
    idle_timeout: float  # the longest gap between two chunks of an upstream body
    secret_headers: frozenset[bytes]  # lower-case names whose values never leave the proxy


def relay_settings(settings: Settings) -> RelaySettings:
    return RelaySettings(
        upstream=settings.upstream,
        inject_usage=settings.inject_usage,
        max_body_bytes=settings.max_body_bytes,
        max_header_bytes=settings.max_header_bytes,
        max_event_bytes=settings.max_event_bytes,
        body_timeout=settings.body_timeout,
        first_byte_timeout=settings.first_byte_timeout,
        idle_timeout=settings.idle_timeout,
        secret_headers=SECRET_HEADERS | {h.lower().encode() for h in settings.secret_headers},
    )


class UpstreamBroke(Exception):
    """Raised to the server after relaying a partial body, so it drops the client's
    connection instead of ending the body cleanly: the client sees the break, as it
    would have without the proxy."""


class ClientGone(Exception):
    """The client left while sending its request."""


class Refused(Exception):
    """A request the proxy answers itself, before anything goes upstream."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


def _body_too_large(limit: int) -> Refused:
    return Refused(413, "request_too_large", f"request body over {limit} bytes")


class Forwarder:
    """The measured relay's ASGI endpoint: shared by all requests, holding no request's state."""

    def __init__(
        self,
        *,
        client: httpx.AsyncClient,
        sinks: Sinks,
        counter: TokenCounter | None,
        settings: RelaySettings,
    ) -> None:
        self.client = client
        self.sinks = sinks
        self.counter = counter
        self.settings = settings

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
        try:  # one normalised path: routed, measured and forwarded alike
            target = normalise(
                scope.get("raw_path") or scope["path"].encode(), scope["query_string"]
            )
        except BadTarget as exc:
            await _send_error(send, 400, "invalid_request_target", str(exc), scope["path"])
            self.sinks.passthrough(route_template(scope["path"]), 400)
            return
        scope = {**scope, "path": target.path, "query_string": target.query.encode()}
        path: str = scope["path"]
        # The seam decides: a POST to a path that has an Api is measured, the rest is not.
        api = api_for(path) if scope["method"] == "POST" else None
        try:
            body = await self._read_body(scope, receive)
        except Refused as refusal:
            await _send_error(send, refusal.status, refusal.kind, refusal.message, path)
            self._count_refusal(path, api, refusal.status, start, started_at)
            return
        except ClientGone:
            if api is not None:
                info, _ = parse_request(api, b"")
                self.sinks.refused(info, ErrorType.CLIENT_CANCELLED, 0, start, started_at)
            return

        if api is None:
            await Relay(self, scope, receive, send, None, start, started_at).run(body, None)
            return
        read = perf_counter()  # the request is in: the proxy's own time starts (overhead)
        info, obj = parse_request(api, body)
        stripper = None
        limits = self.settings
        if limits.inject_usage and info.stream and not info.usage_requested and obj is not None:
            asked = api.ask_for_usage(obj)
            if asked is not None:  # the client gets the stream it asked for: strip the extra
                body, stripper = asked, UsageEventStripper(limits.max_event_bytes)
        relay = Relay(self, scope, receive, send, info, start, started_at)
        relay.read = read
        await relay.run(body, stripper)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        """The whole request body, or `Refused` (431, 413, 408) or `ClientGone`."""
        limits = self.settings
        header_bytes = 0
        for name, value in scope["headers"]:
            header_bytes += len(name) + len(value)
            if name == b"content-length" and value.isdigit() and int(value) > limits.max_body_bytes:
                raise _body_too_large(limits.max_body_bytes)
        if header_bytes > limits.max_header_bytes:
            raise Refused(
                431,
                "request_header_fields_too_large",
                f"request headers over {limits.max_header_bytes} bytes",
            )
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
                        raise _body_too_large(limits.max_body_bytes)
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        except TimeoutError:
            raise Refused(408, "request_timeout", "request body not received in time") from None

    def _count_refusal(
        self, path: str, api: Api | None, status: int, start: float, started_at: float
    ) -> None:
        if api is not None:
            info, _ = parse_request(api, b"")
            self.sinks.refused(info, ErrorType.BAD_REQUEST, status, start, started_at)
        else:
            self.sinks.passthrough(route_template(path), status)


class Relay:
    """One request relayed upstream and its response back: `run` is the whole life.

    Per-request state lives here, never in the Forwarder, as uvicorn's RequestResponseCycle
    and Starlette's per-request responders keep theirs. Three things may cancel the task
    running a relay: the client leaving (`_watch_client`), the idle timer, and the server
    when its drain time runs out. The first two cancel through `cut`, which records their
    cause, so a cancellation without one is the server's.
    """

    __slots__ = (
        "client",
        "counter",
        "cut",
        "idle",
        "info",
        "observer",
        "read",
        "receive",
        "response",
        "rs",
        "scope",
        "send",
        "settings",
        "sinks",
        "start",
        "started_at",
        "status",
    )

    def __init__(
        self,
        forwarder: Forwarder,
        scope: Scope,
        receive: Receive,
        send: Send,
        info: RequestInfo | None,
        start: float,
        started_at: float,
    ) -> None:
        self.client, self.sinks = forwarder.client, forwarder.sinks
        self.counter, self.settings = forwarder.counter, forwarder.settings
        self.scope, self.receive, self.send = scope, receive, send
        self.info, self.start, self.started_at = info, start, started_at
        self.read = start  # when the body was read (the Forwarder sets it)
        self.observer = (
            None
            if info is None
            else StreamObserver(
                info,
                start,
                collect_text=self.counter is not None,
                max_event_bytes=self.settings.max_event_bytes,
            )
        )
        task = asyncio.current_task()
        assert task is not None
        self.cut = _Cut(task)
        self.status = 0  # what the client got
        self.response: httpx.Response | None = None
        self.idle: _IdleTimer | None = None
        self.rs: RequestScope | None = None

    async def run(self, body: bytes, stripper: UsageEventStripper | None) -> None:
        self.rs = self.sinks.begin(self.info, self.scope["headers"], self.started_at)
        cut = self.cut
        watcher = asyncio.create_task(_watch_client(self.receive, cut))
        failure: Failure | None = None
        try:
            stripper = await self.send_request(body, stripper)
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
        await self.finish(perf_counter(), failure)
        if failure is not None and failure.drop:
            raise UpstreamBroke(failure.message)

    # -- the steps --------------------------------------------------------------------

    async def send_request(
        self, body: bytes, stripper: UsageEventStripper | None
    ) -> UsageEventStripper | None:
        """Send the request upstream and the response head to the client. Returns the
        stripper if this response is one to strip."""
        scope = self.scope
        query = scope.get("query_string", b"")
        url = (
            self.settings.upstream
            + scope["path"]
            + ("?" + query.decode("latin-1") if query else "")
        )
        headers = self._upstream_headers()
        if self.observer is not None:
            self.observer.sent(self.read, perf_counter())
        try:
            async with asyncio.timeout(self.settings.first_byte_timeout) as deadline:
                self.response = response = await send_upstream(
                    self.client, scope["method"], url, headers, body
                )
        except TimeoutError:
            if deadline.expired():
                self.cut.cause = Cause.FIRST_BYTE_TIMEOUT
            raise
        self.status = status = response.status_code
        content_type = response.headers.get("content-type", "")
        if self.observer is not None:
            self.observer.open(status, content_type, perf_counter())
        # Only an event stream has a usage event to drop: any other body (a JSON answer
        # to a stream request) passes whole.
        if not (status < 400 and content_type.startswith("text/event-stream")):
            stripper = None
        await self.send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": _client_headers(response, content_type, stripper is not None),
            }
        )
        if self.observer is not None:
            self.observer.relayed(perf_counter())
        return stripper

    async def stream(self, stripper: UsageEventStripper | None) -> None:
        """The per-chunk loop: each read goes to the client, then to the observer. It
        runs for every chunk of every stream; add nothing here that could run once."""
        assert self.response is not None
        send, observer = self.send, self.observer
        strip = None if stripper is None else stripper.feed
        feed = None if observer is None else observer.feed  # None: not (or no longer) measured
        read = body_reader(self.response)
        idle = self.idle = _IdleTimer(self.settings.idle_timeout, self.cut)
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
            if feed is not None:
                try:
                    feed(chunk, now)
                except EventTooLarge:  # relayed all the same, unmeasured from here on
                    self._observer_failed("event_too_large")
                    feed = None
                except Exception:
                    self._observer_failed("observe")
                    feed = None
        if stripper is not None and (rest := stripper.flush()):
            await send({"type": "http.response.body", "body": rest, "more_body": True})
        self.cut.done = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        if feed is not None and observer is not None:
            try:
                observer.end_of_stream(perf_counter())
            except Exception:
                self._observer_failed("observe")

    async def fail(self, cause: Cause, exc: BaseException | None = None) -> Failure:
        """The relay stopped early: what the record says is decided in one table
        (proxy.core.errors.relay_failure); a client that has no response head yet gets
        the proxy's own error answer."""
        self.cut.done = True
        settings = self.settings
        limit = (
            settings.idle_timeout if cause is Cause.IDLE_TIMEOUT else settings.first_byte_timeout
        )
        failure = relay_failure(cause, after_headers=self.status != 0, exc=exc, limit=limit)
        if failure.answer is not None:
            self.status, kind, message = failure.answer
            await _send_error(self.send, self.status, kind, message, self.scope["path"])
        return failure

    async def finish(self, end: float, failure: Failure | None) -> None:
        """The one finish sequence: a measured request's record goes to the sinks (from
        the observer, or bare if measuring it broke); any other is counted by route."""
        rs, observer = self.rs, self.observer
        if observer is None or rs is None:
            self.sinks.passthrough(route_template(self.scope["path"]), self.status)
            return
        error = None if failure is None else failure.error
        message = None if failure is None else failure.message
        try:
            measurement = await observer.finish(
                end=end,
                started_at=self.started_at,
                status_code=self.status,
                error_type=error,
                error_message=message,
                counter=self.counter,
                trace_id=rs.trace_id,
                redact=self._redact,
            )
        except Exception:
            # Still one record (status, e2e, the transport's error type), so the request
            # is counted and the in-flight gauge comes down.
            log.exception("measuring a request failed")
            self.sinks.failed("finish")
            measurement = bare_record(
                observer.request,
                status_code=self.status,
                started_at=self.started_at,
                e2e=end - observer.start,
                error_type=error,
                error_message=None if message is None else self._redact(message),
                trace_id=rs.trace_id,
            )
        self.sinks.end(rs, measurement)

    # -- beside the steps -------------------------------------------------------------

    def _observer_failed(self, stage: str) -> None:
        """The one place observer failures stop: the stream goes on, the record is kept
        to what is safe, and a counter says so."""
        if stage == "observe":
            log.exception("observer failed; the stream goes on unmeasured")
        else:
            log.warning("stream no longer measured (%s); it goes on unchanged", stage)
        self.sinks.failed(stage)
        if self.observer is not None:
            self.observer.fail()

    def _upstream_headers(self) -> list[tuple[bytes, bytes]]:
        headers = _upstream_headers(self.scope["headers"], measured=self.info is not None)
        assert self.rs is not None
        if self.rs.upstream_headers:
            # The proxy's span replaces the client's trace headers (it is the client's
            # span's child), so the backend sees exactly one traceparent.
            names = {name for name, _ in self.rs.upstream_headers}
            headers = [(k, v) for k, v in headers if k not in names and k != b"tracestate"]
            headers.extend(self.rs.upstream_headers)
        return headers

    def _redact(self, message: str) -> str:
        """Upstreams sometimes echo credentials in error text: mask every secret header's value."""
        secret = self.settings.secret_headers
        for name, value in self.scope["headers"]:
            if name in secret and len(value) >= 4:
                text = value.decode("latin-1")
                message = message.replace(text, "[redacted]")
                token = text.partition(" ")[2]
                if len(token) >= 4:
                    message = message.replace(token, "[redacted]")
        return message


class _Cut:
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


async def _watch_client(receive: Receive, cut: _Cut) -> None:
    # A send to a gone client can succeed silently: only receive() tells.
    while (await receive())["type"] != "http.disconnect":
        pass
    cut(Cause.CLIENT_GONE)


class _IdleTimer:
    """Cuts the relay when the upstream sends nothing for `limit` seconds.

    One timer per response, not one per chunk as a transport's read timeout would arm
    (about 3 µs a chunk, a twentieth of relaying it): the relay only notes when it starts
    waiting on the upstream (`waiting`; None while it writes to the client, so a slow
    client is not taken for a silent upstream), and the timer re-arms itself while the
    current wait is younger than `limit`.
    """

    __slots__ = ("cut", "handle", "limit", "waiting")

    def __init__(self, limit: float, cut: _Cut) -> None:
        self.limit = limit
        self.cut = cut
        self.waiting: float | None = None
        self.handle = asyncio.get_running_loop().call_later(limit, self._check)

    def _check(self) -> None:
        waited = 0.0 if self.waiting is None else perf_counter() - self.waiting
        if waited >= self.limit:
            self.cut(Cause.IDLE_TIMEOUT)
        else:  # loop timers may fire a little early: never re-arm for less than a millisecond
            delay = max(self.limit - waited, 0.001)
            self.handle = asyncio.get_running_loop().call_later(delay, self._check)

    def cancel(self) -> None:
        self.handle.cancel()


def _upstream_headers(
    headers: list[tuple[bytes, bytes]], *, measured: bool
) -> list[tuple[bytes, bytes]]:
    drop = _REQUEST_DROP
    for name, value in headers:
        if name == b"connection":  # the headers it names are hop-by-hop too (RFC 9110 §7.6.1)
            drop = drop | {t.strip().lower() for t in value.split(b",")}
    out = [(k, v) for k, v in headers if k not in drop]
    if measured:
        # The observer must read the stream, so measured responses come uncompressed
        # (vLLM does not compress them anyway).
        out.append((b"accept-encoding", b"identity"))
    else:
        out.extend((k, v) for k, v in headers if k == b"accept-encoding")
    return out


def _client_headers(
    response: httpx.Response, content_type: str, body_changes: bool
) -> list[tuple[bytes, bytes]]:
    drop = _HOP_BY_HOP | {b"content-length"} if body_changes else _HOP_BY_HOP
    out = [(k.lower(), v) for k, v in response.headers.raw if k.lower() not in drop]
    if content_type.startswith("text/event-stream"):
        out.append((b"x-accel-buffering", b"no"))  # so an nginx in front does not buffer
    return out


async def _send_error(send: Send, status: int, kind: str, message: str, path: str) -> None:
    """An error from the proxy itself (only before any byte was sent), shaped for `path`."""
    body = error_body(status, kind, message, shape=error_shape(path))
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


__all__ = ["Forwarder", "TokenCounts", "UpstreamBroke"]
