"""An error vLLM reports inside a 200 stream is counted as the same error answered with a
status would be: a client's bad request is bad_request, a server's failure stream_error.

vLLM 0.32 checks a request's structured output (a grammar, a regex, a JSON schema) only
once its stream has begun, and answers a bad one with a 400 inside it; not streamed, the
same request is a 400 answer, which was bad_request while the stream was stream_error, a
server fault on the dashboards. The bytes below are vLLM 0.32's own, captured direct from
it (/tmp/hunt-drop/out/bad_schema_stream.direct, comp_bad_schema_stream.direct) or, for
its server faults, written as its source writes them (vllm/entrypoints/generate/base/
serving.py create_streaming_error_response; anthropic/serving.py message_stream_converter).

Each test runs on both data paths, in a real `tokenprobe serve` in front of a RawUpstream
replaying them (conftest.py). Shown able to fail: each was run against the tree before.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import httpx
import pytest

from tests.hostile.peers import Conn, Handler, RawUpstream, Request, by_target
from tests.hostile.shared import counted, until

REQUESTS = "tokenprobe_requests_total"

#: vLLM 0.32, a chat stream with a json_schema whose $ref points nowhere: the 200, then
#: the 400 as an event (xgrammar's words), then [DONE].
CHAT_BAD_SCHEMA = (
    b'data: {"error": {"message": "Grammar error: Pointer \'/nowhere\' does not exist", '
    b'"type": "BadRequestError", "param": null, "code": 400}}\n\n'
    b"data: [DONE]\n\n"
)
#: vLLM 0.32, the engine failing mid-generation (a GenerationError): a 500 inside.
CHAT_GENERATION_ERROR = (
    b'data: {"error": {"message": "Internal server error", "type": "InternalServerError", '
    b'"param": null, "code": 500}}\n\n'
    b"data: [DONE]\n\n"
)
#: vLLM 0.32's Messages layer, whatever failed inside (its only in-stream error type).
MESSAGES_INTERNAL_ERROR = (
    b"event: error\n"
    b'data: {"type":"error","error":{"type":"internal_error",'
    b'"message":"EngineCore encountered an issue. See stack trace (above) for the root cause."}}'
    b"\n\n"
)


def stream(body: bytes) -> bytes:
    """A 200 event stream carrying `body`, in one chunk, as uvicorn frames vLLM's."""
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
        b"transfer-encoding: chunked\r\n\r\n" + b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)
    )


def answer(response: bytes) -> Handler:
    async def handler(conn: Conn, request: Request) -> None:
        conn.write(response)
        await conn.drain()

    return handler


CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
COMPLETIONS = ("/v1/completions", {"prompt": "hi"})
MESSAGES = ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})


@pytest.mark.parametrize(
    ("route", "body", "error_type"),
    [
        (CHAT, CHAT_BAD_SCHEMA, "bad_request"),
        (COMPLETIONS, CHAT_BAD_SCHEMA, "bad_request"),
        (CHAT, CHAT_GENERATION_ERROR, "stream_error"),
        (MESSAGES, MESSAGES_INTERNAL_ERROR, "stream_error"),
    ],
    ids=["chat-bad-schema", "completions-bad-schema", "chat-engine-500", "messages-internal"],
)
def test_an_in_stream_error_counts_as_what_it_says(
    upstream: RawUpstream,
    proxy: Callable[..., AbstractContextManager[str]],
    route: tuple[str, dict[str, object]],
    body: bytes,
    error_type: str,
) -> None:
    """Was stream_error for all four: a client's bad schema counted against the server."""
    target, fields = route
    upstream.default = by_target({target.encode(): answer(stream(body))})
    with proxy(upstream.url) as base:
        got = httpx.post(base + target, json={"model": "m", "stream": True, **fields}, timeout=30)
        assert got.status_code == 200, got.text
        assert got.content == body  # relayed unchanged: only the record reads it
        assert until(lambda: counted(base, REQUESTS, error_type=error_type) == 1), error_type
        assert counted(base, REQUESTS) == 1
