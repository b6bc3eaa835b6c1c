"""The bytes vLLM puts on the wire, built from templates so no chunk needs json.dumps.

Streamed chat chunks (vLLM serializes with `exclude_unset`, so unset `usage` is absent):

  role    {"id","object":"chat.completion.chunk","created","model",
           "choices":[{"index":0,"delta":{"role":"assistant","content":""},
                       "logprobs":null,"finish_reason":null}]}
  content ... "choices":[{"index":0,"delta":{"content":"<text>"},"logprobs":null,
                          "finish_reason":null}]
  finish  ... "choices":[{"index":0,"delta":{"content":""},"logprobs":null,
                          "finish_reason":"stop","stop_reason":null}]
  last    ... "choices":[{"index":0,"delta":{"content":"<text>"},"logprobs":null,
                          "finish_reason":"length","stop_reason":null}]
  usage   ... "choices":[],"usage":{"prompt_tokens","total_tokens","completion_tokens"
                                   [,"prompt_tokens_details":{"cached_tokens"}]}

`finish` is the chunk of an EOS token (a token with no text); `last` is the chunk of a
token that ends the generation itself (the token limit: vLLM's finish_reason comes with
the output that carries it, chat_completion/serving.py, completion/serving.py). With
`n` > 1 every choice has chunks of its own, `"index":<i>` (`index=`).

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

    __slots__ = (
        "_chat",
        "_head",
        "_head_json",
        "_post",
        "_pre",
        "_stamp",
        "_stamp_pre",
        "fingerprint",
    )

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
            self._post = b'"},"logprobs":null,"finish_reason":null}]'
        else:
            self._post = b'","logprobs":null,"finish_reason":null,"stop_reason":null}]'
        self._chat = chat
        self._head_json = head
        self._head = b"data: {" + head
        # choice 0's openings, built once: nearly every chunk is one of them
        self._pre = self._head + self._opening(0)
        self._stamp_pre = b"," + head + self._opening(0)
        self._stamp = stamp

    def _opening(self, index: int) -> bytes:
        field = b'"delta":{"content":"' if self._chat else b'"text":"'
        return b',"choices":[{"index":%d,' % index + field

    def role(self, usage: bytes | None = None, index: int = 0) -> bytes:
        return (
            self._head
            + b',"choices":[{"index":%d,"delta":{"role":"assistant","content":""},' % index
            + b'"logprobs":null,"finish_reason":null}]'
            + _tail(usage, None)
        )

    def content(self, text: bytes, usage: bytes | None = None, index: int = 0) -> bytes:
        """A content chunk; `text` is already escaped for the inside of a JSON string."""
        tail = b"}\n\n" if usage is None else b',"usage":' + usage + b"}\n\n"
        return self._text_chunk(text, index, self._post, tail)

    def _text_chunk(self, text: bytes, index: int, post: bytes, tail: bytes) -> bytes:
        if index:
            pre, stamp_pre = self._head + self._opening(index), b"," + self._head_json
            stamp_pre += self._opening(index)
        else:
            pre, stamp_pre = self._pre, self._stamp_pre
        if self._stamp == "text":
            return pre + stamp_text(text) + post + tail
        if self._stamp:
            return b'data: {"sent_ns":%d' % time.time_ns() + stamp_pre + text + post + tail
        return pre + text + post + tail

    def last(
        self,
        text: bytes,
        finish_reason: str,
        usage: bytes | None = None,
        fingerprint: bytes | None = None,
        index: int = 0,
        stop_reason: str | None = None,
    ) -> bytes:
        """The chunk of a token that ends the generation (the token limit, a stop string):
        its text and the finish together, stamped as a content chunk."""
        return self._text_chunk(
            text, index, self._finish_post(finish_reason, stop_reason), _tail(usage, fingerprint)
        )

    def finish(
        self,
        finish_reason: str,
        usage: bytes | None = None,
        fingerprint: bytes | None = None,
        index: int = 0,
    ) -> bytes:
        """The terminal chunk of an EOS token (no text); vLLM 0.32 stamps `fingerprint`
        (JSON) on a terminal chunk only when no usage chunk follows."""
        return (
            self._head
            + self._opening(index)
            + self._finish_post(finish_reason, None)
            + _tail(usage, fingerprint)
        )

    def _finish_post(self, finish_reason: str, stop_reason: str | None) -> bytes:
        return b'"%s,"logprobs":null,"finish_reason":%s,"stop_reason":%s}]' % (
            b"}" if self._chat else b"",
            orjson.dumps(finish_reason),
            orjson.dumps(stop_reason),
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


def _tail(usage: bytes | None, fingerprint: bytes | None) -> bytes:
    return (
        (b"" if usage is None else b',"usage":' + usage)
        + (b"" if fingerprint is None else b',"system_fingerprint":' + fingerprint)
        + b"}\n\n"
    )


def full_completion(
    chat: bool,
    response_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str,
    usage: bytes,
    metrics: bytes | None = None,
    n: int = 1,
    stop_reason: str | None = None,
) -> bytes:
    """A non-streamed chat completion or text completion, as vLLM returns it (with vLLM
    0.32's per-request `metrics` last, when asked for): `n` choices, each with `text`."""
    choices: list[dict[str, Any]]
    if chat:
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
            for i in range(n)
        ]
    else:
        choices = [
            {
                "index": i,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
                "prompt_logprobs": None,
            }
            for i in range(n)
        ]
    body = {
        "id": response_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": orjson.Fragment(usage),
        "prompt_logprobs": None,
    }
    if metrics is not None:
        body["metrics"] = orjson.Fragment(metrics)
    return orjson.dumps(body)
