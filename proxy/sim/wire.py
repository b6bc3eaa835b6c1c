"""The bytes vLLM puts on the wire, built from templates so no chunk needs json.dumps.

Streamed chat chunks (vLLM serializes with `exclude_unset`, so unset `usage` is absent):

  role    {"id","object":"chat.completion.chunk","created","model",
           "choices":[{"index":0,"delta":{"role":"assistant","content":""},
                       "logprobs":null,"finish_reason":null}]}
  content ... "choices":[{"index":0,"delta":{"content":"<text>"},"logprobs":null,
                          "finish_reason":null}]
  finish  ... "choices":[{"index":0,"delta":{"content":""},"logprobs":null,
                          "finish_reason":"stop","stop_reason":null}]
  usage   ... "choices":[],"usage":{"prompt_tokens","total_tokens","completion_tokens"
                                   [,"prompt_tokens_details":{"cached_tokens"}]}

Completions use `"object":"text_completion"` and choices `{"index":0,"text":"<text>",
"logprobs":null,"finish_reason":null,"stop_reason":null}`, with no role chunk.
Every event is `data: <json>\\n\\n`; the stream ends with `data: [DONE]\\n\\n`.

With `stamp` "key", each content chunk starts with `"sent_ns":<time.time_ns()>` as its
first key, taken just before the write, so a client can measure added latency per chunk;
with "text", the text starts with `@<time.time_ns()> ` instead (`stamp_text`), and the
chunks differ only in their text, as vLLM's do.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"
#: vLLM's in-stream error after a generation failure.
ERROR_EVENT = (
    b'data: {"error":{"message":"Internal server error","type":"InternalServerError",'
    b'"param":null,"code":500}}\n\n'
)
ERROR_STRING_EVENT = b'data: {"error":"upstream generation failed"}\n\n'
MALFORMED_EVENT = b"data: {not json\n\n"


#: Where a content chunk carries its send time: "" (nowhere), "key" or "text" (SimConfig).
STAMPS = ("", "key", "text")


def stamp_mode(configured: bool, in_text: bool, header: str) -> str:
    """The stamp of one request: the `x-sim-stamp` header (1/true: key; text) or the config."""
    if header == "text" or (configured and in_text and header not in ("1", "true")):
        return "text"
    return "key" if configured or header in ("1", "true") else ""


def stamp_text(text: bytes) -> bytes:
    """`text` (JSON-escaped) behind its send time, `@<time.time_ns()> `."""
    return b"@%d " % time.time_ns() + text


def usage_json(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> bytes:
    """vLLM's UsageInfo, in its field order; details only when there is something cached."""
    out = b'{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d' % (
        prompt_tokens,
        prompt_tokens + completion_tokens,
        completion_tokens,
    )
    if cached_tokens is not None:
        out += b',"prompt_tokens_details":{"cached_tokens":%d}' % cached_tokens
    return out + b"}"


class StreamWire:
    """The events of one streamed response. Build once per request; call per chunk."""

    __slots__ = ("_chat", "_head", "_post", "_pre", "_stamp", "_stamp_pre", "fingerprint")

    def __init__(
        self,
        chat: bool,
        response_id: str,
        created: int,
        model: str,
        stamp: str,
        fingerprint: str | None = None,
    ):
        self.fingerprint = None if fingerprint is None else orjson.dumps(fingerprint)
        obj = b"chat.completion.chunk" if chat else b"text_completion"
        head = b'"id":%s,"object":"%s","created":%d,"model":%s' % (
            orjson.dumps(response_id),
            obj,
            created,
            orjson.dumps(model),
        )
        if chat:
            opening = b',"choices":[{"index":0,"delta":{"content":"'
            self._post = b'"},"logprobs":null,"finish_reason":null}]'
        else:
            opening = b',"choices":[{"index":0,"text":"'
            self._post = b'","logprobs":null,"finish_reason":null,"stop_reason":null}]'
        self._chat = chat
        self._head = b"data: {" + head
        self._pre = self._head + opening
        self._stamp_pre = b"," + head + opening
        self._stamp = stamp

    def role(self, usage: bytes | None = None) -> bytes:
        return (
            self._head
            + b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
            + b'"logprobs":null,"finish_reason":null}]'
            + _usage_tail(usage)
        )

    def content(self, text: bytes, usage: bytes | None = None) -> bytes:
        """A content chunk; `text` is already escaped for the inside of a JSON string."""
        tail = b"}\n\n" if usage is None else b',"usage":' + usage + b"}\n\n"
        if self._stamp == "text":
            return self._pre + stamp_text(text) + self._post + tail
        if self._stamp:
            return (
                b'data: {"sent_ns":%d' % time.time_ns() + self._stamp_pre + text + self._post + tail
            )
        return self._pre + text + self._post + tail

    def finish(
        self, finish_reason: str, usage: bytes | None = None, fingerprint: bytes | None = None
    ) -> bytes:
        """The terminal chunk; vLLM 0.32 stamps `fingerprint` (JSON) here only when no usage
        chunk follows."""
        delta = b'"delta":{"content":""}' if self._chat else b'"text":""'
        return (
            self._head
            + b',"choices":[{"index":0,'
            + delta
            + b',"logprobs":null,"finish_reason":%s,"stop_reason":null}]'
            % orjson.dumps(finish_reason)
            + (b"" if usage is None else b',"usage":' + usage)
            + (b"" if fingerprint is None else b',"system_fingerprint":' + fingerprint)
            + b"}\n\n"
        )

    def usage(
        self, usage: bytes, fingerprint: bytes | None = None, metrics: bytes | None = None
    ) -> bytes:
        """The usage chunk, with vLLM 0.32's fingerprint and per-request `metrics` after it."""
        return (
            self._head
            + b',"choices":[],"usage":'
            + usage
            + (b"" if fingerprint is None else b',"system_fingerprint":' + fingerprint)
            + (b"" if metrics is None else b',"metrics":' + metrics)
            + b"}\n\n"
        )


def _usage_tail(usage: bytes | None) -> bytes:
    return b"}\n\n" if usage is None else b',"usage":' + usage + b"}\n\n"


def full_completion(
    chat: bool,
    response_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str,
    usage: bytes,
    metrics: bytes | None = None,
) -> bytes:
    """A non-streamed chat completion or text completion, as vLLM returns it (with vLLM
    0.32's per-request `metrics` last, when asked for)."""
    choice: dict[str, Any]
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "prompt_logprobs": None,
        }
    body = {
        "id": response_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": orjson.Fragment(usage),
        "prompt_logprobs": None,
    }
    if metrics is not None:
        body["metrics"] = orjson.Fragment(metrics)
    return orjson.dumps(body)
