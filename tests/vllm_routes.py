"""A stand-in for the vLLM routes the simulator does not serve yet: recorded Messages and
Responses streams replayed with programmed timing, and vLLM's small utility routes.

A raw ASGI app on real uvicorn (tests/servers.py). Streams send their opening events
(message_start, ping, response.created, ...) at once with the headers, wait `ttft`
seconds, then send the rest one event every `gap` seconds, so a measured TTFT must be at
least `ttft`: start events at t≈0 are not the first token. Every byte sent is kept, for
comparing with what the client received.

Utility bodies follow vLLM (vllm-project/vllm: vllm/entrypoints/serve/tokenize/protocol.py
for /tokenize and /detokenize, vllm/entrypoints/anthropic/protocol.py for count_tokens,
vllm/entrypoints/openai/api_server.py for /version, /health, /ping).
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from tests.paths import STREAMS
from tests.servers import request_body

#: The events of each stream sent with the headers, before the programmed wait.
OPENING = {"vllm_messages.sse": 3, "vllm_messages_error.sse": 2, "vllm_responses.sse": 4}
#: (status, content type, body) of the utility routes, by (method, path).
UTILITY: dict[tuple[str, str], tuple[int, bytes, bytes]] = {
    ("POST", "/tokenize"): (
        200,
        b"application/json",
        b'{"count":3,"max_model_len":4096,"tokens":[9906,1070,0],"token_strs":null}',
    ),
    ("POST", "/detokenize"): (200, b"application/json", b'{"prompt":"Hello there!"}'),
    ("GET", "/version"): (200, b"application/json", b'{"version":"0.32.0"}'),
    ("GET", "/health"): (200, b"application/json", b""),
    ("GET", "/ping"): (200, b"application/json", b""),
    ("POST", "/ping"): (200, b"application/json", b""),
    ("POST", "/v1/messages/count_tokens"): (
        200,
        b"application/json",
        b'{"input_tokens":12,"context_management":null}',
    ),
}


def stream_events(name: str) -> list[bytes]:
    raw = (STREAMS / name).read_bytes()
    return [part + b"\n\n" for part in raw.split(b"\n\n") if part]


def final_response(name: str) -> dict[str, Any]:
    """The complete response object a non-streaming Responses request answers with."""
    last = stream_events(name)[-1]
    obj: dict[str, Any] = orjson.loads(last.split(b"data: ", 1)[1])["response"]
    return obj


MESSAGE_BODY = {
    "id": "msg_0a1b2c3d",
    "type": "message",
    "role": "assistant",
    "model": "sim-model",
    "content": [{"type": "text", "text": "Hello there!"}],
    "stop_reason": "max_tokens",
    "stop_sequence": None,
    "usage": {"input_tokens": 12, "output_tokens": 3},
}


class VllmRoutes:
    def __init__(self, ttft: float = 0.3, gap: float = 0.02) -> None:
        self.ttft = ttft
        self.gap = gap
        self.sent: list[bytes] = []  # the body bytes of each response, in order

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = await request_body(receive)
        method, path = scope["method"], scope["path"]
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        request = orjson.loads(body) if body and method == "POST" else {}
        if (method, path) in UTILITY:
            await self._reply(send, *UTILITY[(method, path)])
        elif path in ("/v1/messages", "/v1/responses") and "x-status" in headers:
            status = int(headers["x-status"])
            error = {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
            await self._reply(send, status, b"application/json", orjson.dumps(error))
        elif path == "/v1/chat/completions" and request.get("stream"):
            await self._choices(send, int(request.get("n", 1)), int(headers["x-tokens"]))
        elif path == "/v1/messages" and request.get("stream"):
            await self._stream(send, headers.get("x-stream", "vllm_messages.sse"))
        elif path == "/v1/messages":
            await self._reply(send, 200, b"application/json", orjson.dumps(MESSAGE_BODY))
        elif path == "/v1/responses" and request.get("stream"):
            await self._stream(send, "vllm_responses.sse")
        elif path == "/v1/responses":
            body = orjson.dumps(final_response("vllm_responses_incomplete.sse"))
            await self._reply(send, 200, b"application/json", body)
        else:
            await self._reply(send, 404, b"application/json", b'{"detail":"Not Found"}')

    async def _reply(self, send: Any, status: int, content_type: bytes, body: bytes) -> None:
        headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        self.sent.append(body)  # before its last byte goes: the client may check at once
        await send({"type": "http.response.body", "body": body})

    async def _choices(self, send: Any, n: int, tokens: int) -> None:
        """A chat stream with n choices, as vLLM interleaves them: one chunk per choice
        (with its `index`) per decode step, one step every `gap` seconds."""
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        sent = []

        async def event(obj: dict[str, Any]) -> None:
            data = b"data: " + orjson.dumps(obj) + b"\n\n"
            sent.append(data)
            await send({"type": "http.response.body", "body": data, "more_body": True})

        base = {"id": "chatcmpl-n", "object": "chat.completion.chunk", "model": "m"}
        for index in range(n):
            delta = {"role": "assistant", "content": ""}
            await event({**base, "choices": [{"index": index, "delta": delta}]})
        await asyncio.sleep(self.ttft)
        for step in range(tokens):
            for index in range(n):
                finish = "stop" if step == tokens - 1 else None
                choice = {"index": index, "delta": {"content": "x"}, "finish_reason": finish}
                await event({**base, "choices": [choice]})
            await asyncio.sleep(self.gap)
        usage = {
            "prompt_tokens": 5,
            "completion_tokens": n * tokens,
            "total_tokens": 5 + n * tokens,
        }
        await event({**base, "choices": [], "usage": usage})
        self.sent.append(b"".join(sent) + b"data: [DONE]\n\n")  # before the end goes out
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    async def _stream(self, send: Any, name: str) -> None:
        events = stream_events(name)
        opening = OPENING[name]
        headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        first = b"".join(events[:opening])
        await send({"type": "http.response.body", "body": first, "more_body": True})
        await asyncio.sleep(self.ttft)
        for event in events[opening:]:
            await send({"type": "http.response.body", "body": event, "more_body": True})
            await asyncio.sleep(self.gap)
        # Noted before the body ends: the client has it all then, and may compare at once
        # (noted after, a test once read `sent` before the backend's thread appended it).
        self.sent.append(b"".join(events))
        await send({"type": "http.response.body", "body": b""})
