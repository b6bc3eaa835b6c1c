"""Every way a relayed request can end, driven in-process through the ASGI interface: what
only the ASGI relay can show (the same exits over sockets, on both paths, are
tests/server/test_exits_inprocess.py).

The proxy app runs on the test's own event loop, called as `await app(scope, receive,
send)` with a fake server side written here (`Client`). The assembly is handed an
`httpx.MockTransport` serving a scripted body (`UpstreamBody`) as its upstream transport, so
the real relay code runs unchanged between the two, without sockets, in milliseconds.
Each test asserts on what the client was sent, on the record the sinks got, and on the
registry. The end-to-end tests (tests/server/test_proxy_e2e.py, tests/server/test_faults.py) keep
checking the same paths over real sockets.

The streams are the recorded vLLM ones in tests/fixtures/streams (see tests/core/test_observe.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, NoReturn

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry

from proxy.core.measurement import ErrorType, Measurement, TokenSource
from proxy.core.observe import StreamObserver
from proxy.core.request import CHAT
from proxy.server.app import ProxyApp
from proxy.server.assemble import assemble
from proxy.server.forward import UpstreamBroke
from proxy.settings import Settings
from proxy.sinks.sink import Labels, Recorder, Sink
from proxy.types import Message
from tests.builds import replaces_observer_methods
from tests.paths import ERRORS, STREAMS
from tests.server.conftest import paths

MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # the model the recorded streams name


pytestmark = paths(
    "asgi",
    why="drives the ASGI app through its ASGI interface with a mock upstream transport; "
    "tests/server/test_exits_inprocess.py runs the same exits on both paths over sockets",
)


UPSTREAM = "http://upstream.test"
SECRET = b"sk-relay-test-0123456789"

STREAM = (STREAMS / "vllm_chat.sse").read_bytes()
#: The recorded stream as the backend wrote it: one network read per event.
EVENTS = [part + b"\n\n" for part in STREAM.split(b"\n\n") if part]
BODY = (STREAMS / "vllm_chat_response.json").read_bytes().strip()

Step = bytes | BaseException | asyncio.Event


# -- the upstream -------------------------------------------------------------------------


class UpstreamBody(httpx.AsyncByteStream):
    """A scripted response body. Each step is a chunk to send, an exception to raise (the
    connection broke), or an event to wait for (`silence()` is one that never comes).
    Records whether the relay closed it."""

    def __init__(self, *steps: Step) -> None:
        self.steps = steps
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for step in self.steps:
            if isinstance(step, BaseException):
                raise step
            if isinstance(step, asyncio.Event):
                await step.wait()
                continue
            yield step

    async def aclose(self) -> None:
        self.closed = True


def silence() -> asyncio.Event:
    """A step the upstream never gets past: it says nothing more until it is closed."""
    return asyncio.Event()


class Upstream:
    """The backend: answers every request with `respond`, keeps what it was sent."""

    def __init__(self, respond: Callable[[httpx.Request], Awaitable[httpx.Response]]) -> None:
        self.respond = respond
        self.requests: list[httpx.Request] = []
        self.reached = asyncio.Event()

        self.cancelled = False

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        self.reached.set()
        try:
            return await self.respond(request)
        except asyncio.CancelledError:
            self.cancelled = True  # the backend would abort the request here
            raise


def streaming(body: UpstreamBody) -> Upstream:
    async def respond(_: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=body)

    return Upstream(respond)


def failing(exc: Exception) -> Upstream:
    async def respond(_: httpx.Request) -> NoReturn:
        raise exc

    return Upstream(respond)


def never_answering() -> Upstream:
    async def respond(_: httpx.Request) -> NoReturn:
        await silence().wait()
        raise AssertionError("unreachable")

    return Upstream(respond)


# -- the client side of the ASGI server ---------------------------------------------------


class Client:
    """The fake ASGI server: delivers the request body on `receive`, then waits until
    the client leaves (`leave()`, or by itself after `leave_after` body chunks, or once
    the body has ended with `leave_at_end`) and reports `http.disconnect`. Keeps every message the app sent."""

    def __init__(
        self, body: bytes, *, leave_after: int | None = None, leave_at_end: bool = False
    ) -> None:
        self.messages: list[Message] = []
        self._pending = [{"type": "http.request", "body": body, "more_body": False}]
        self._gone = asyncio.Event()
        self._leave_after = leave_after
        self._leave_at_end = leave_at_end
        self.got_body = asyncio.Event()

    async def receive(self) -> Message:
        if self._pending:
            return self._pending.pop()
        await self._gone.wait()
        return {"type": "http.disconnect"}

    def leave(self) -> None:
        self._gone.set()

    async def send(self, message: Message) -> None:
        self.messages.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            self.got_body.set()
            if self._leave_after is not None and len(self.chunks) >= self._leave_after:
                self._gone.set()
        if self._leave_at_end and self.ended:
            self._gone.set()
            await asyncio.sleep(0)  # the server sees the disconnect before the app goes on

    @property
    def status(self) -> int:
        assert self.messages and self.messages[0]["type"] == "http.response.start"
        return int(self.messages[0]["status"])

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(self.messages[0]["headers"])

    @property
    def chunks(self) -> list[bytes]:
        return [m["body"] for m in self.messages if m["type"] == "http.response.body" and m["body"]]

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    @property
    def ended(self) -> bool:
        """The body was ended cleanly (the last message had more_body false)."""
        last = self.messages[-1]
        return last["type"] == "http.response.body" and not last.get("more_body", False)


def chat_request(*, stream: bool = True) -> bytes:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 256,
        "temperature": 0.7,
    }
    if stream:
        # Usage asked for by the client, so the proxy forwards the request unchanged.
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return orjson.dumps(body)


def http_scope(path: str = CHAT, method: str = "POST") -> Message:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"proxy.test"),
            (b"content-type", b"application/json"),
            (b"authorization", b"Bearer " + SECRET),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 4000),
    }


# -- the proxy ----------------------------------------------------------------------------


@dataclass
class Proxy:
    app: ProxyApp
    records: list[Measurement]

    async def call(self, client: Client, scope: Message | None = None) -> None:
        async with asyncio.timeout(2):  # a hung relay fails the test instead of stalling it
            await self.app(scope or http_scope(), client.receive, client.send)

    def start(self, client: Client, scope: Message | None = None) -> asyncio.Task[None]:
        """The request as its own task, as the server runs it (so the test can cancel it)."""
        return asyncio.create_task(self.call(client, scope))

    def sample(self, name: str, **labels: str) -> float:
        return self.app.registry.get_sample_value(name, labels) or 0.0

    @property
    def in_flight(self) -> float:
        return self.sample("tokenprobe_requests_in_flight", model=MODEL, endpoint=CHAT)

    def requests(self, code: int, finish_reason: str, error_type: str) -> float:
        """tokenprobe_requests_total for MODEL on the chat endpoint."""
        labels = {"code": str(code), "finish_reason": finish_reason, "error_type": error_type}
        return self.sample("tokenprobe_requests_total", model=MODEL, endpoint=CHAT, **labels)

    def failures(self, stage: str) -> float:
        return self.sample("tokenprobe_measurement_failures_total", stage=stage)

    @property
    def record(self) -> Measurement:
        assert len(self.records) == 1, self.records
        return self.records[0]


@contextlib.asynccontextmanager
async def running(
    upstream: Upstream,
    *,
    sinks: Iterable[Sink] = (),
    **settings: Any,
) -> AsyncIterator[Proxy]:
    recorder = Recorder()
    app = assemble(
        Settings(
            upstream=UPSTREAM,
            model_allowlist=(MODEL,),
            models_refresh=None,
            access_log="off",
            **settings,
        ),
        {},
        registry=CollectorRegistry(),
        extra_sinks=[*sinks, recorder],
        transport=httpx.MockTransport(upstream.handle),
    )
    await app.startup()
    try:
        yield Proxy(app, recorder.records)
    finally:
        await app.shutdown()


# -- success ------------------------------------------------------------------------------


def test_streamed_success_relays_each_read_unchanged_and_records_the_usage() -> None:
    async def scenario() -> None:
        body = UpstreamBody(*EVENTS)
        upstream = streaming(body)
        async with running(upstream) as proxy:
            client = Client(chat_request())
            await proxy.call(client)

            assert client.status == 200
            assert client.chunks == EVENTS  # one send per upstream read, none merged or held
            assert client.body == STREAM
            assert client.ended
            assert client.headers[b"content-type"] == b"text/event-stream"
            sent = upstream.requests[0]
            assert sent.content == chat_request()
            assert sent.headers["authorization"] == "Bearer " + SECRET.decode()
            assert body.closed
            record = proxy.record
            assert (record.status_code, record.error_type, record.finish_reason) == (
                200,
                None,
                "stop",
            )
            assert (record.prompt_tokens, record.output_tokens, record.cached_prompt_tokens) == (
                12,
                4,
                8,
            )
            assert record.token_source is TokenSource.USAGE
            assert record.ttft is not None and record.ttfb is not None
            assert record.ttfb <= record.ttft <= record.e2e
            assert proxy.requests(200, "stop", "none") == 1
            assert proxy.in_flight == 0

    asyncio.run(scenario())


def test_a_finished_relay_is_freed_at_once_not_by_the_garbage_collector() -> None:
    """A relay's buffers (up to --max-event-bytes in the observer and the stripper) must
    go when the request ends: a reference cycle would keep them until a collection, and
    RSS would climb under load (tests/server/test_faults.py checks the process's RSS)."""

    def observers() -> int:
        return sum(isinstance(o, StreamObserver) for o in gc.get_objects())

    async def scenario() -> None:
        async with running(streaming(UpstreamBody(*EVENTS))) as proxy:
            gc.collect()
            gc.disable()
            try:
                await proxy.call(Client(chat_request()))
                for _ in range(3):  # let the cancelled client watcher finish
                    await asyncio.sleep(0)
                assert observers() == 0
            finally:
                gc.enable()

    asyncio.run(scenario())


def test_non_streamed_success_relays_the_body_unchanged_with_its_length() -> None:
    async def scenario() -> None:
        headers = {"content-type": "application/json", "content-length": str(len(BODY))}

        async def respond(_: httpx.Request) -> httpx.Response:
            return httpx.Response(200, headers=headers, stream=UpstreamBody(BODY))

        async with running(Upstream(respond)) as proxy:
            client = Client(chat_request(stream=False))
            await proxy.call(client)

            assert client.status == 200
            assert client.body == BODY
            assert client.ended
            assert client.headers[b"content-length"] == str(len(BODY)).encode()
            record = proxy.record
            assert (record.stream, record.error_type, record.finish_reason) == (
                False,
                None,
                "length",
            )
            assert (record.prompt_tokens, record.output_tokens) == (12, 16)
            assert proxy.in_flight == 0

    asyncio.run(scenario())


def test_unmeasured_request_is_relayed_and_counted_as_passthrough() -> None:
    async def scenario() -> None:
        models = b'{"object":"list","data":[]}'

        async def respond(_: httpx.Request) -> httpx.Response:
            return httpx.Response(
                200, headers={"content-type": "application/json"}, stream=UpstreamBody(models)
            )

        async with running(Upstream(respond)) as proxy:
            client = Client(b"")
            await proxy.call(client, http_scope("/v1/models", "GET"))

            assert (client.status, client.body, client.ended) == (200, models, True)
            assert proxy.records == []
            passthrough = {"route": "/v1/models", "code": "200"}
            assert proxy.sample("tokenprobe_passthrough_requests_total", **passthrough) == 1

    asyncio.run(scenario())


# -- the upstream fails -------------------------------------------------------------------


def test_connect_error_before_headers_answers_502_upstream_unreachable() -> None:
    async def scenario() -> None:
        async with running(failing(httpx.ConnectError("connection refused"))) as proxy:
            client = Client(chat_request())
            await proxy.call(client)

            assert client.status == 502
            error = orjson.loads(client.body)["error"]
            assert error["type"] == "upstream_unreachable"
            assert error["message"].startswith("upstream: ")
            record = proxy.record
            assert (record.status_code, record.error_type) == (
                502,
                ErrorType.UPSTREAM_UNREACHABLE,
            )
            assert proxy.requests(502, "none", "upstream_unreachable") == 1
            assert proxy.in_flight == 0

    asyncio.run(scenario())


def test_no_headers_within_first_byte_timeout_answers_504_upstream_timeout() -> None:
    async def scenario() -> None:
        upstream = never_answering()
        async with running(upstream, first_byte_timeout=0.05) as proxy:
            client = Client(chat_request())
            await proxy.call(client)

            assert client.status == 504
            error = orjson.loads(client.body)["error"]
            assert error["type"] == "upstream_timeout"
            message = "no response within 0.05 s (--first-byte-timeout)"
            assert error["message"] == "upstream: " + message
            record = proxy.record
            assert (record.status_code, record.error_type) == (504, ErrorType.UPSTREAM_TIMEOUT)
            assert record.error_message == message
            assert record.e2e >= 0.05
            assert upstream.cancelled
            assert proxy.in_flight == 0

    asyncio.run(scenario())


def test_error_status_is_relayed_unchanged_and_classified_from_its_body() -> None:
    async def scenario() -> None:
        reply = (ERRORS / "vllm_prompt_too_long_input_tokens.json").read_bytes()
        headers = {"content-type": "application/json", "content-length": str(len(reply))}

        async def respond(_: httpx.Request) -> httpx.Response:
            return httpx.Response(400, headers=headers, stream=UpstreamBody(reply))

        async with running(Upstream(respond)) as proxy:
            client = Client(chat_request())
            await proxy.call(client)

            assert (client.status, client.body, client.ended) == (400, reply, True)
            record = proxy.record
            assert (record.status_code, record.error_type) == (400, ErrorType.CONTEXT_LENGTH)
            assert record.error_message and "tokens" in record.error_message
            assert proxy.requests(400, "none", "context_length") == 1
            assert proxy.in_flight == 0

    asyncio.run(scenario())


def test_break_after_headers_relays_what_came_then_drops_the_client() -> None:
    async def scenario() -> None:
        body = UpstreamBody(EVENTS[0], EVENTS[1], httpx.ReadError("connection reset by peer"))
        async with running(streaming(body)) as proxy:
            client = Client(chat_request())
            # UpstreamBroke asks the server to drop the connection: the client sees the
            # break, as it would have without the proxy, not a cleanly ended body.
            with pytest.raises(UpstreamBroke):
                await proxy.call(client)

            assert client.status == 200
            assert client.chunks == EVENTS[:2]
            assert not client.ended
            assert body.closed
            record = proxy.record
            assert (record.status_code, record.error_type) == (200, ErrorType.STREAM_TRUNCATED)
            assert record.ttft is not None  # the first content event did arrive
            assert proxy.in_flight == 0

    asyncio.run(scenario())


def test_idle_upstream_is_cut_after_idle_timeout_as_upstream_timeout() -> None:
    async def scenario() -> None:
        body = UpstreamBody(EVENTS[0], EVENTS[1], silence())
        async with running(streaming(body), idle_timeout=0.05) as proxy:
            client = Client(chat_request())
            with pytest.raises(UpstreamBroke):
                await proxy.call(client)

            assert client.chunks == EVENTS[:2]
            assert not client.ended
            assert body.closed
            record = proxy.record
            assert (record.status_code, record.error_type) == (200, ErrorType.UPSTREAM_TIMEOUT)
            assert record.error_message == "no data from the upstream for 0.05 s"
            assert record.e2e >= 0.05
            assert proxy.in_flight == 0

    asyncio.run(scenario())


# -- the server cuts the request (drain time over at shutdown) ----------------------------


def test_drain_cut_mid_stream_records_stream_truncated_and_drops_the_client() -> None:
    async def scenario() -> None:
        body = UpstreamBody(EVENTS[0], EVENTS[1], silence())
        async with running(streaming(body)) as proxy:
            client = Client(chat_request())
            task = proxy.start(client)
            await client.got_body.wait()
            task.cancel()  # what uvicorn does to requests still running when the drain ends
            with pytest.raises(UpstreamBroke):
                await task

            assert client.chunks in (EVENTS[:1], EVENTS[:2])  # the second may race the cut
            assert not client.ended
            assert body.closed
            record = proxy.record
            assert (record.status_code, record.error_type) == (200, ErrorType.STREAM_TRUNCATED)
            assert record.error_message is not None and "shut down" in record.error_message
            assert proxy.in_flight == 0

    asyncio.run(scenario())


def test_drain_cut_before_headers_answers_503_proxy_shutting_down() -> None:
    async def scenario() -> None:
        upstream = never_answering()
        async with running(upstream) as proxy:
            client = Client(chat_request())
            task = proxy.start(client)
            await upstream.reached.wait()
            task.cancel()
            await task  # the relay answers the client itself and ends the request

            assert client.status == 503
            assert orjson.loads(client.body)["error"]["type"] == "proxy_shutting_down"
            assert client.ended
            record = proxy.record
            assert (record.status_code, record.error_type) == (503, ErrorType.UPSTREAM_ERROR)
            assert proxy.in_flight == 0

    asyncio.run(scenario())


# -- the client leaves --------------------------------------------------------------------


def test_client_gone_mid_stream_closes_the_upstream_and_records_client_cancelled() -> None:
    async def scenario() -> None:
        body = UpstreamBody(EVENTS[0], EVENTS[1], silence())
        async with running(streaming(body)) as proxy:
            client = Client(chat_request(), leave_after=1)
            await proxy.call(client)  # a gone client is no error of the server's

            assert client.chunks in (EVENTS[:1], EVENTS[:2])  # the second may race the cut
            assert not client.ended
            assert body.closed  # so the backend aborts the generation and frees its cache
            record = proxy.record
            assert (record.status_code, record.error_type) == (200, ErrorType.CLIENT_CANCELLED)
            assert proxy.in_flight == 0

    asyncio.run(scenario())


def test_client_gone_before_headers_cancels_the_upstream_request_and_sends_nothing() -> None:
    async def scenario() -> None:
        upstream = never_answering()
        async with running(upstream) as proxy:
            client = Client(chat_request())
            task = proxy.start(client)
            await upstream.reached.wait()
            client.leave()
            await task

            assert client.messages == []  # no one is there to answer
            assert upstream.cancelled
            record = proxy.record
            assert (record.status_code, record.error_type) == (0, ErrorType.CLIENT_CANCELLED)
            assert record.error_message == "client disconnected"
            assert proxy.requests(0, "none", "client_cancelled") == 1
            assert proxy.in_flight == 0

    asyncio.run(scenario())


def test_client_leaving_after_the_body_ended_is_no_cancellation() -> None:
    async def scenario() -> None:
        async with running(streaming(UpstreamBody(*EVENTS))) as proxy:
            client = Client(chat_request(), leave_at_end=True)
            await proxy.call(client)

            assert (client.body, client.ended) == (STREAM, True)
            assert proxy.record.error_type is None
            assert proxy.requests(200, "stop", "none") == 1

    asyncio.run(scenario())


# -- measuring fails; the request does not ------------------------------------------------


@replaces_observer_methods
def test_observer_failure_keeps_the_stream_and_still_writes_a_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken_feed(self: StreamObserver, chunk: bytes, now: float) -> NoReturn:
        raise RuntimeError("observer bug")

    monkeypatch.setattr(StreamObserver, "feed", broken_feed)

    async def scenario() -> None:
        async with running(streaming(UpstreamBody(*EVENTS))) as proxy:
            client = Client(chat_request())
            await proxy.call(client)

            assert client.body == STREAM
            assert client.ended
            assert proxy.failures("observe") == 1
            assert proxy.in_flight == 0
            assert proxy.record.status_code == 200

    asyncio.run(scenario())


def test_event_over_the_limit_is_relayed_unmeasured_and_counted() -> None:
    async def scenario() -> None:
        # Every event of the recorded stream is over 64 bytes: the first one stops measuring.
        async with running(streaming(UpstreamBody(*EVENTS)), max_event_bytes=64) as proxy:
            client = Client(chat_request())
            await proxy.call(client)

            assert client.chunks == EVENTS
            assert client.ended
            assert proxy.failures("event_too_large") == 1
            assert proxy.failures("observe") == 0
            record = proxy.record  # kept to what is safe: no tokens, no TTFT
            assert (record.status_code, record.error_type) == (200, None)
            assert (record.ttft, record.output_tokens) == (None, None)
            assert record.token_source is TokenSource.NONE
            assert proxy.in_flight == 0

    asyncio.run(scenario())


@replaces_observer_methods
def test_failure_while_finishing_the_record_still_writes_a_bare_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def broken_finish(self: StreamObserver, **_: Any) -> NoReturn:
        raise RuntimeError("finish bug")

    monkeypatch.setattr(StreamObserver, "finish", broken_finish)

    async def scenario() -> None:
        body = UpstreamBody(EVENTS[0], httpx.ReadError("connection reset by peer"))
        async with running(streaming(body)) as proxy:
            client = Client(chat_request())
            with pytest.raises(UpstreamBroke):
                await proxy.call(client)

            assert client.chunks == EVENTS[:1]
            assert proxy.failures("finish") == 1
            record = proxy.record  # the transport's verdict survives
            assert (record.status_code, record.error_type) == (200, ErrorType.STREAM_TRUNCATED)
            assert record.token_source is TokenSource.NONE
            assert proxy.requests(200, "none", "stream_truncated") == 1
            assert proxy.in_flight == 0

    asyncio.run(scenario())


def test_sink_failure_is_counted_and_the_request_and_other_sinks_go_on() -> None:
    class BrokenSink:
        def record(self, measurement: Measurement, labels: Labels) -> None:
            raise RuntimeError("sink bug")

    async def scenario() -> None:
        async with running(streaming(UpstreamBody(*EVENTS)), sinks=[BrokenSink()]) as proxy:
            client = Client(chat_request())
            await proxy.call(client)

            assert client.body == STREAM
            assert client.ended
            assert proxy.failures("sink") == 1
            assert proxy.record.error_type is None  # the sink after the broken one got it
            assert proxy.requests(200, "stop", "none") == 1
            assert proxy.in_flight == 0

    asyncio.run(scenario())
