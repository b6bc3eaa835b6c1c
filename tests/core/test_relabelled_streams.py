"""A stream asked for, sent as an event stream under another Content-Type.

Some gateways answer a stream request with `Content-Type: application/json` (or none) over
an SSE body; vLLM 0.32 itself labels its streams `text/event-stream`
(vllm/entrypoints/openai/chat_completion/api_router.py and completion/api_router.py,
`StreamingResponse(..., media_type="text/event-stream")`). The relay passes the bytes as
they come either way; the observer measures such a body as the stream it is when its
first non-blank bytes open an event stream (`data:`, `event:`, or a comment such as vLLM's
`: keep-alive`), which no JSON document can begin with. A JSON answer (a whole answer
from a backend that ignores `stream`, an error's `{"error": ...}`) is the body it was.

The differential: vLLM 0.32's captured streams replayed under each label give the record
the same stream gives labelled `text/event-stream`, read by read and byte by byte.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest

from proxy.core.apis import api_for
from proxy.core.measurement import ErrorType, Measurement, TokenSource
from proxy.core.observe import StreamObserver
from proxy.core.request import RequestInfo
from tests.paths import FIXTURES

START = 100.0
OPENED = 100.125
MODEL = "tiny"
#: vLLM 0.32's captures (tests/fixtures/streams/vllm-0.32/README.md), by endpoint.
CAPTURES = [
    ("/v1/chat/completions", "chat_stream_include_usage.sse"),
    ("/v1/completions", "completions_stream_include_usage.sse"),
    ("/v1/messages", "messages_stream.sse"),
    ("/v1/responses", "responses_stream.sse"),
]
#: Labels a gateway may put on a stream it passes on.
LABELS = ["application/json", "application/json; charset=utf-8", "text/plain", ""]
#: vLLM's keep-alive comment (--sse-keep-alive-interval: vllm/entrypoints/serve/utils/
#: sse_keep_alive.py, SSE_KEEP_ALIVE_COMMENT), written while the first token is awaited.
KEEP_ALIVE = b": keep-alive\n\n"


def reads_of(name: str) -> list[bytes]:
    """A captured stream, one read per event."""
    raw = (FIXTURES / "streams" / "vllm-0.32" / name).read_bytes()
    return [part + b"\n\n" for part in raw.split(b"\n\n") if part]


def info(endpoint: str, stream: bool = True) -> RequestInfo:
    return RequestInfo(endpoint, MODEL, stream, True, 256, 0.7)


def observe(
    endpoint: str,
    content_type: str,
    reads: list[bytes],
    status: int = 200,
    stream: bool = True,
    byte_at_a_time: bool = False,
) -> tuple[StreamObserver, Measurement]:
    """Reads an eighth of a second apart (each byte of a read at its read's time)."""
    observer = StreamObserver(info(endpoint, stream), start=START, api=api_for(endpoint))
    observer.open(status, content_type, OPENED)
    for i, chunk in enumerate(reads):
        now = OPENED + (i + 1) / 8
        pieces = [chunk[j : j + 1] for j in range(len(chunk))] if byte_at_a_time else [chunk]
        for piece in pieces:
            observer.feed(piece, now)
    end = OPENED + (len(reads) + 1) / 8
    observer.end_of_stream(end)
    record = asyncio.run(
        observer.finish(
            end=end, started_at=1.0, status_code=status, error_type=None, error_message=None
        )
    )
    return observer, record


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize(("endpoint", "name"), CAPTURES)
def test_a_stream_under_another_label_gives_the_event_streams_record(
    endpoint: str, name: str, label: str
) -> None:
    reads = reads_of(name)
    _, want = observe(endpoint, "text/event-stream", reads)
    assert want.ttft is not None and want.token_source is TokenSource.USAGE and want.ok
    observer, got = observe(endpoint, label, reads)
    assert got == want
    assert observer.relabelled


@pytest.mark.parametrize(("endpoint", "name"), CAPTURES)
def test_its_opening_split_over_reads_is_still_told(endpoint: str, name: str) -> None:
    reads = reads_of(name)
    _, want = observe(endpoint, "text/event-stream", reads, byte_at_a_time=True)
    _, got = observe(endpoint, "application/json", reads, byte_at_a_time=True)
    assert got == want and got.ttft is not None


@pytest.mark.parametrize("opening", [b"\r\n", b"\n\n", KEEP_ALIVE, b"\n" + KEEP_ALIVE])
def test_blank_lines_and_keep_alives_before_the_first_event(opening: bytes) -> None:
    reads = [opening, *reads_of("chat_stream_include_usage.sse")]
    _, want = observe("/v1/chat/completions", "text/event-stream", reads)
    for byte_at_a_time in (False, True):
        _, got = observe("/v1/chat/completions", "application/json", reads, 200, True,
                         byte_at_a_time)  # fmt: skip
        assert got == want and got.ttft == want.ttft


def test_a_whole_json_answer_to_a_stream_request_is_a_body() -> None:
    """A backend that ignores `stream` answers one JSON object: measured as today."""
    body = (FIXTURES / "streams" / "vllm_chat_response.json").read_bytes()
    for reads in ([body], [b"\n", body], [body[:1], body[1:3], body[3:]]):
        observer, m = observe("/v1/chat/completions", "application/json", reads)
        assert not observer.streaming
        assert (m.stream, m.ttft, m.token_source, m.malformed_events) == (
            False, None, TokenSource.USAGE, 0)  # fmt: skip
        assert m.finish_reason == "length"  # the capture ran into its max_tokens


# vLLM 0.32's ErrorResponse (vllm/entrypoints/serve/engine/protocol.py: `error: ErrorInfo`
# with message, type, param, code), and the flat shape of older vLLMs (`object: "error"`).
ERRORS = [
    {"error": {"message": "busy", "type": "BadRequestError", "param": None, "code": 400}},
    {"object": "error", "message": "busy", "type": "BadRequestError", "param": None,
     "code": 400},
]  # fmt: skip


@pytest.mark.parametrize("error", ERRORS)
@pytest.mark.parametrize("status", [200, 400])
def test_a_json_error_answer_to_a_stream_request_stays_an_error_body(
    error: dict[str, object], status: int
) -> None:
    body = orjson.dumps(error)
    observer, m = observe("/v1/chat/completions", "application/json", [body], status)
    assert not observer.streaming
    assert (m.stream, m.ttft, m.malformed_events) == (False, None, 0)
    if status == 400:
        assert m.error_type is ErrorType.BAD_REQUEST and m.error_message == "busy"


def test_a_request_that_asked_for_no_stream_is_never_read_as_one() -> None:
    """Only a stream that was asked for is looked for: an event-stream body to a request
    without `stream` stays the body it was labelled (not JSON: one malformed event)."""
    reads = reads_of("chat_stream_include_usage.sse")
    observer, m = observe("/v1/chat/completions", "application/json", reads, stream=False)
    assert not observer.streaming
    assert (m.stream, m.ttft, m.malformed_events) == (False, None, 1)


def test_an_ndjson_api_is_not_looked_at() -> None:
    """Ollama's lines begin as a JSON body does: nothing tells them apart at the start."""
    line = b'{"model":"m","message":{"role":"assistant","content":"hi"},"done":false}\n'
    observer, m = observe("/api/chat", "application/json", [line])
    assert not observer.streaming and m.stream is False


def test_it_is_said_once_when_the_stream_is_told() -> None:
    told: list[float] = []
    observer = StreamObserver(info("/v1/chat/completions"), start=START)
    observer.open(200, "application/json", OPENED)
    observer.on_relabelled = lambda: told.append(1.0)
    first, *rest = reads_of("chat_stream_include_usage.sse")
    for chunk in [b"\n", first[:2], first[2:], *rest]:
        observer.feed(chunk, OPENED)
    assert told == [1.0]
