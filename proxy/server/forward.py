"""The hot path: relay one request upstream and its response back, byte for byte.

Each chunk goes to the client first; only then does the observer see it, with the time of
the network read. Which requests are measured, and how, is the API seam's business
(proxy/core/apis): a POST to a path with an Api. Observer failures are caught here, in one
place: the stream carries on unmeasured, the request still ends in one record (status,
e2e, the transport's error type) and a counter says so. A client that goes away (seen on `receive()`, because a
send to a gone client can succeed silently) cancels the upstream request at once, so the
backend aborts the generation and frees its KV cache.
"""

from __future__ import annotations

import asyncio
import logging
from time import perf_counter, time
from typing import Any

import httpx

from proxy.core.apis import Api, api_for
from proxy.core.errors import error_body, error_shape
from proxy.core.labels import route_template
from proxy.core.measurement import ErrorType
from proxy.core.observe import StreamObserver, TokenCounts, bare_record
from proxy.core.paths import BadTarget, normalise
from proxy.core.request import RequestInfo, parse_request
from proxy.core.sse import DEFAULT_MAX_EVENT_BYTES, EventTooLarge
from proxy.core.strip import UsageEventStripper
from proxy.core.tokens import TokenCounter
from proxy.server.upstream import body_reader, classify_exception, describe, send_upstream
from proxy.sinks.dispatch import Sinks
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
#: Request headers whose values never appear in logs, traces, metrics or error messages.
SECRET_HEADERS = frozenset(
    {b"authorization", b"proxy-authorization", b"api-key", b"x-api-key", b"cookie", b"set-cookie"}
)
_STATUS_FOR_ERROR = {
    ErrorType.UPSTREAM_UNREACHABLE: 502,
    ErrorType.UPSTREAM_ERROR: 502,
    ErrorType.UPSTREAM_TIMEOUT: 504,
}


class UpstreamBroke(Exception):
    """Raised to the server after relaying a partial body, so it drops the client's
    connection instead of ending the body cleanly: the client sees the break, as it
    would have without the proxy."""


class ClientGone(Exception):
    pass


class BodyTooLarge(Exception):
    pass


class HeadersTooLarge(Exception):
    pass


class _Watch:
    __slots__ = ("finished", "gone")

    def __init__(self) -> None:
        self.finished = False
        self.gone = False


class Forwarder:
    def __init__(
        self,
        *,
        client: httpx.AsyncClient,
        upstream: str,
        sinks: Sinks,
        counter: TokenCounter | None,
        inject_usage: bool,
        max_body_bytes: int,
        max_header_bytes: int,
        body_timeout: float,
        first_byte_timeout: float,
        secret_headers: tuple[str, ...] = (),
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
    ) -> None:
        self.max_event_bytes = max_event_bytes
        self.client = client
        self.upstream = upstream
        self.sinks = sinks
        self.counter = counter
        self.inject_usage = inject_usage
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes
        self.body_timeout = body_timeout
        self.first_byte_timeout = first_byte_timeout
        self.secret_headers = SECRET_HEADERS | {h.lower().encode() for h in secret_headers}

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
        except HeadersTooLarge:
            await _send_error(
                send,
                431,
                "request_header_fields_too_large",
                f"request headers over {self.max_header_bytes} bytes",
                path,
            )
            self._count_refusal(path, api, 431, start, started_at)
            return
        except BodyTooLarge:
            await _send_error(
                send,
                413,
                "request_too_large",
                f"request body over {self.max_body_bytes} bytes",
                path,
            )
            self._count_refusal(path, api, 413, start, started_at)
            return
        except TimeoutError:
            await _send_error(
                send, 408, "request_timeout", "request body not received in time", path
            )
            self._count_refusal(path, api, 408, start, started_at)
            return
        except ClientGone:
            if api is not None:
                info, _ = parse_request(api, b"")
                self.sinks.refused(info, ErrorType.CLIENT_CANCELLED, 0, start, started_at)
            return

        if api is None:
            await self._relay(scope, receive, send, body, None, None, start, started_at)
            return
        info, obj = parse_request(api, body)
        stripper = None
        if self.inject_usage and info.stream and not info.usage_requested and obj is not None:
            asked = api.ask_for_usage(obj)
            if asked is not None:  # the client gets the stream it asked for: strip the extra
                body, stripper = asked, UsageEventStripper(self.max_event_bytes)
        await self._relay(scope, receive, send, body, info, stripper, start, started_at)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        header_bytes = 0
        for name, value in scope["headers"]:
            header_bytes += len(name) + len(value)
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body_bytes:
                raise BodyTooLarge
        if header_bytes > self.max_header_bytes:
            raise HeadersTooLarge
        chunks: list[bytes] = []
        size = 0
        async with asyncio.timeout(self.body_timeout):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise BodyTooLarge
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _relay(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        body: bytes,
        info: RequestInfo | None,
        stripper: UsageEventStripper | None,
        start: float,
        started_at: float,
    ) -> None:
        rs = self.sinks.begin(info, scope["headers"], started_at)
        headers = _upstream_headers(scope["headers"], measured=info is not None)
        if rs.upstream_headers:
            # The proxy's span replaces the client's trace headers (it is the client's
            # span's child), so the backend sees exactly one traceparent.
            names = {name for name, _ in rs.upstream_headers}
            headers = [(k, v) for k, v in headers if k not in names and k != b"tracestate"]
            headers.extend(rs.upstream_headers)
        query = scope.get("query_string", b"")
        url = self.upstream + scope["path"] + ("?" + query.decode("latin-1") if query else "")
        observer = None
        if info is not None:
            observer = StreamObserver(
                info,
                start,
                collect_text=self.counter is not None,
                max_event_bytes=self.max_event_bytes,
            )
        feeding = observer is not None

        task = asyncio.current_task()
        assert task is not None
        watch = _Watch()
        watcher = asyncio.create_task(_watch_disconnect(receive, task, watch))
        response: httpx.Response | None = None
        idle: _IdleTimer | None = None
        status = 0  # what the client got
        error: ErrorType | None = None
        message: str | None = None
        broke = False
        try:
            async with asyncio.timeout(self.first_byte_timeout):
                response = await send_upstream(self.client, scope["method"], url, headers, body)
            status = response.status_code
            content_type = response.headers.get("content-type", "")
            if observer is not None:
                observer.open(status, content_type, perf_counter())
            # Only an event stream has a usage event to drop: any other body (a JSON
            # answer to a stream request) passes whole.
            stripping = (
                stripper is not None
                and status < 400
                and content_type.startswith("text/event-stream")
            )
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": _client_headers(response, content_type, stripping),
                }
            )
            idle = _IdleTimer(self.client.timeout.read, task)
            read = body_reader(response)
            while True:
                idle.waiting = perf_counter()
                chunk = await read()
                idle.waiting = None
                if not chunk:
                    break
                now = perf_counter()
                out = stripper.feed(chunk) if stripping else chunk  # type: ignore[union-attr]
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                if feeding:
                    try:
                        observer.feed(chunk, now)  # type: ignore[union-attr]
                    except EventTooLarge:  # relayed all the same, unmeasured from here on
                        feeding = self._observer_failed(observer, "event_too_large")
                    except Exception:
                        feeding = self._observer_failed(observer)
            if stripping and (rest := stripper.flush()):  # type: ignore[union-attr]
                await send({"type": "http.response.body", "body": rest, "more_body": True})
            watch.finished = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            if feeding:
                try:
                    observer.end_of_stream(perf_counter())  # type: ignore[union-attr]
                except Exception:
                    feeding = self._observer_failed(observer)
        except asyncio.CancelledError:
            task.uncancel()
            if watch.gone:
                error, message = ErrorType.CLIENT_CANCELLED, "client disconnected"
            elif idle is not None and idle.fired:
                watch.finished = True
                error, broke = ErrorType.UPSTREAM_TIMEOUT, True
                message = f"no data from the upstream for {idle.limit:g} s"
            else:
                # The server cancels what is left when the drain time runs out. Record the
                # request, then end it like a broken upstream: the client sees the cut.
                watch.finished = True
                message = "cut off: the proxy shut down before the response ended"
                if status:
                    error, broke = ErrorType.STREAM_TRUNCATED, True
                else:
                    error, status = ErrorType.UPSTREAM_ERROR, 503
                    await _send_error(send, status, "proxy_shutting_down", message, scope["path"])
        except Exception as exc:
            watch.finished = True
            started = status != 0
            error, message = classify_exception(exc, after_headers=started), describe(exc)
            if response is None and type(exc) is TimeoutError and not str(exc):  # our timeout
                message = f"no response within {self.first_byte_timeout:g} s (--first-byte-timeout)"
            if started:
                broke = True  # the client already has part of a body: drop its connection
            else:
                status = _STATUS_FOR_ERROR.get(error, 502)
                await _send_error(send, status, error.value, f"upstream: {message}", scope["path"])
        finally:
            watch.finished = True
            watcher.cancel()
            if idle is not None:
                idle.cancel()
            if response is not None:
                await response.aclose()
        end = perf_counter()

        if info is None:
            self.sinks.passthrough(route_template(scope["path"]), status)
        else:
            assert observer is not None
            await self._finish(
                rs, observer, status, error, message, end, started_at, scope["headers"]
            )
        if broke:
            raise UpstreamBroke(message)

    async def _finish(
        self,
        rs: Any,
        observer: StreamObserver,
        status: int,
        error: ErrorType | None,
        message: str | None,
        end: float,
        started_at: float,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        def redact(text: str) -> str:
            return self._redact(text, headers)

        try:
            measurement = await observer.finish(
                end=end,
                started_at=started_at,
                status_code=status,
                error_type=error,
                error_message=message,
                counter=self.counter,
                trace_id=rs.trace_id,
                redact=redact,
            )
        except Exception:
            # Still one record (status, e2e, the transport's error type), so the request
            # is counted and the in-flight gauge comes down.
            log.exception("measuring a request failed")
            self.sinks.failed("finish")
            measurement = bare_record(
                observer.request,
                status_code=status,
                started_at=started_at,
                e2e=end - observer.start,
                error_type=error,
                error_message=None if message is None else redact(message),
                trace_id=rs.trace_id,
            )
        self.sinks.end(rs, measurement)

    def _redact(self, message: str, headers: list[tuple[bytes, bytes]]) -> str:
        """Upstreams sometimes echo credentials in error text: mask every secret header's value."""
        for name, value in headers:
            if name in self.secret_headers and len(value) >= 4:
                text = value.decode("latin-1")
                message = message.replace(text, "[redacted]")
                token = text.partition(" ")[2]
                if len(token) >= 4:
                    message = message.replace(token, "[redacted]")
        return message

    def _observer_failed(self, observer: StreamObserver | None, stage: str = "observe") -> bool:
        """The one place observer failures stop: the stream goes on, the record is kept
        to what is safe, and a counter says so. Returns the new `feeding` flag."""
        if stage == "observe":
            log.exception("observer failed; the stream goes on unmeasured")
        else:
            log.warning("stream no longer measured (%s); it goes on unchanged", stage)
        self.sinks.failed(stage)
        if observer is not None:
            observer.fail()
        return False

    def _count_refusal(
        self, path: str, api: Api | None, status: int, start: float, started_at: float
    ) -> None:
        if api is not None:
            info, _ = parse_request(api, b"")
            self.sinks.refused(info, ErrorType.BAD_REQUEST, status, start, started_at)
        else:
            self.sinks.passthrough(route_template(path), status)


class _IdleTimer:
    """Cancels the relay when the upstream sends nothing for `limit` seconds.

    One timer per response, not one per chunk as a transport's read timeout would arm
    (about 3 µs a chunk, a twentieth of relaying it): the relay only notes when it starts
    waiting on the upstream (`waiting`; None while it writes to the client, so a slow
    client is not taken for a silent upstream), and the timer re-arms itself while the
    current wait is younger than `limit`.
    """

    __slots__ = ("fired", "handle", "limit", "task", "waiting")

    def __init__(self, limit: float | None, task: asyncio.Task[Any]) -> None:
        self.limit = limit
        self.task = task
        self.fired = False
        self.waiting: float | None = None
        self.handle = (
            None if limit is None else asyncio.get_running_loop().call_later(limit, self._check)
        )

    def _check(self) -> None:
        assert self.limit is not None
        waited = 0.0 if self.waiting is None else perf_counter() - self.waiting
        if waited >= self.limit:
            self.fired = True
            self.task.cancel()
        else:  # loop timers may fire a little early: never re-arm for less than a millisecond
            delay = max(self.limit - waited, 0.001)
            self.handle = asyncio.get_running_loop().call_later(delay, self._check)

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()


async def _watch_disconnect(receive: Receive, task: asyncio.Task[Any], watch: _Watch) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not watch.finished:
                watch.gone = True
                task.cancel()
            return


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
