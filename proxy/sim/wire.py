"""The bytes vLLM puts on the wire, built from templates so no chunk needs json.dumps.

Streamed chunks are vLLM 0.32's pydantic models dumped with `exclude_unset`: a field the
serving code passes explicitly is written even when null, one it leaves at its default is
not, and every key goes in the model's field order (openai/chat_completion/protocol.py
ChatCompletionStreamResponse and ChatCompletionResponseStreamChoice; openai/completion/
protocol.py CompletionStreamResponse and CompletionResponseStreamChoice; what is passed:
chat_completion/serving.py chat_completion_stream_generator, completion/serving.py
completion_stream_generator; checked key by key against the captures in
tests/fixtures/streams/vllm-0.32). Streamed chat:

  role    {"id","object":"chat.completion.chunk","created","model",
           "choices":[{"index":0,"delta":{"role":"assistant","content":""},
                       "logprobs":null,"finish_reason":null}],
           ["usage":{...},]"prompt_token_ids":null,"prompt_text":null}
  content ... "choices":[{"index":0,"delta":{"content":"<text>"},"logprobs":null,
                          "finish_reason":null,"token_ids":null}]
  finish  ... "choices":[{"index":0,"delta":{"content":""},"logprobs":null,
                          "finish_reason":"stop","stop_reason":null,"token_ids":null}]
  last    ... "choices":[{"index":0,"delta":{"content":"<text>"},"logprobs":null,
                          "finish_reason":"length","stop_reason":null,"token_ids":null}]
  usage   ... "choices":[],"usage":{"prompt_tokens","total_tokens","completion_tokens"
                                   [,"prompt_tokens_details":{"cached_tokens"
                                                              [,"created_cache_tokens"]}]}

The usage chunk is dumped with `exclude_none` as well (no nulls); a chat chunk's continuous
usage (`stream_options.continuous_usage_stats`) ends with `"completion_tokens_details":null`,
which chat passes explicitly and completions do not (`continuous_usage_json`).

`finish` is the chunk of an EOS token (a token with no text); `last` is the chunk of a
token that ends the generation itself (the token limit: vLLM's finish_reason comes with
the output that carries it, chat_completion/serving.py, completion/serving.py). With
`n` > 1 every choice has chunks of its own, `"index":<i>` (`index=`).

Completions use `"object":"text_completion"` and choices `{"index":0,"text":"<text>",
"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,
"token_ids":null}`, with no role chunk.
Every event is `data: <json>\\n\\n`; the stream ends with `data: [DONE]\\n\\n`.

Non-streamed bodies are the response models' plain `model_dump()` (chat_completion/
api_router.py, completion/api_router.py: `JSONResponse(content=generator.model_dump())`):
every field, nulls included, in field order (`full_completion`).

With `stamp` "key", each content chunk starts with `"sent_ns":<time.time_ns()>` as its
first key, taken just before the write, so a client can measure added latency per chunk;
with "text", the text starts with `@<time.time_ns()> ` instead (`stamp_text`), and the
chunks differ only in their text, as vLLM's do.
"""

from __future__ import annotations

import json
import time
from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"
#: vLLM's in-stream error after a generation failure: GenerationError's default message
#: (vllm/exceptions.py GenerationError) as create_error_response puts it, dumped with
#: `json.dumps`, hence the spaces (generate/base/serving.py create_streaming_error_response,
#: _convert_generation_error_to_streaming_response; chat and completions alike).
ERROR_EVENT = (
    b'data: {"error": {"message": "Internal server error", "type": "InternalServerError", '
    b'"param": null, "code": 500}}\n\n'
)
#: Not vLLM's: the bare-string error some OpenAI-compatible servers send.
ERROR_STRING_EVENT = b'data: {"error":"upstream generation failed"}\n\n'
MALFORMED_EVENT = b"data: {not json\n\n"


def chat_error_message(chat_error: bytes) -> str:
    """The message of a chat stream's error event (ERROR_EVENT, ERROR_STRING_EVENT)."""
    error = json.loads(chat_error.removeprefix(b"data: "))["error"]
    return str(error["message"] if isinstance(error, dict) else error)


def converted_error(chat_error: bytes) -> str:
    """What vLLM 0.32's Messages and Cohere layers report when the chat stream they convert
    sends `chat_error`: they parse every chat chunk as a ChatCompletionStreamResponse, so
    an error chunk fails pydantic's validation (no `model`, no `choices`) and the
    ValidationError's text, through sanitize_message, is the message
    (anthropic/serving.py message_stream_converter and cohere/serving.py
    _chat_completion_stream_to_v2, each `except Exception as e`). The text is pydantic
    2.14's (vLLM 0.32's venv): an input's repr over 50 characters is cut to its first 25
    and last 24 around "..."."""
    value = repr(json.loads(chat_error.removeprefix(b"data: ")))
    if len(value) > 50:
        value = value[:25] + "..." + value[-24:]
    field = (
        f"  Field required [type=missing, input_value={value}, input_type=dict]\n"
        "    For further information visit https://errors.pydantic.dev/2.14/v/missing"
    )
    return f"2 validation errors for ChatCompletionStreamResponse\nmodel\n{field}\nchoices\n{field}"


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


def cache_writes(prompt_tokens: int, cached_tokens: int, block: int) -> int:
    """The prompt tokens a request writes to the prefix cache: its whole blocks less those
    it found there (v1/metrics/stats.py PrefillStats.finalize, from the scheduler's
    estimate_cached_tokens, v1/core/kv_cache_manager.py: the full blocks' tokens), in the
    KV cache's blocks of `block` tokens, the same blocks its cache hits come in."""
    return max(0, prompt_tokens - prompt_tokens % block - cached_tokens)


def usage_json(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int | None,
    created_cache_tokens: int | None = None,
) -> bytes:
    """vLLM's UsageInfo as a usage chunk dumps it (`exclude_none`), in its field order;
    details only when there is something cached. vLLM's PromptTokenUsageInfo
    (serve/engine/protocol.py) is {cached_tokens, created_cache_tokens, multimodal_tokens}:
    chat sets the first two (chat_completion/serving.py _make_prompt_tokens_details),
    completions and generate only `cached_tokens` (`created_cache_tokens` None here)."""
    out = b'{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d' % (
        prompt_tokens,
        prompt_tokens + completion_tokens,
        completion_tokens,
    )
    if cached_tokens is not None:
        out += b',"prompt_tokens_details":{"cached_tokens":%d' % cached_tokens
        if created_cache_tokens is not None:
            out += b',"created_cache_tokens":%d' % created_cache_tokens
        out += b"}"
    return out + b"}"


def continuous_usage_json(chat: bool, prompt_tokens: int, completion_tokens: int) -> bytes:
    """The usage on every chunk under `continuous_usage_stats`: no prompt details, and chat
    passes `completion_tokens_details` explicitly, null without a reasoning parser
    (chat_completion/serving.py, `chunk.usage = UsageInfo(...)`; completion/serving.py
    passes only the three counts)."""
    out = usage_json(prompt_tokens, completion_tokens, None)
    return out[:-1] + b',"completion_tokens_details":null}' if chat else out


def full_usage_json(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int | None,
    created_cache_tokens: int | None = None,
) -> bytes:
    """A non-streamed body's UsageInfo, dumped whole (`model_dump()`): the details are null
    when unset, and carry every PromptTokenUsageInfo field, nulls included, when set."""
    out = usage_json(prompt_tokens, completion_tokens, None)[:-1]
    if cached_tokens is None:
        out += b',"prompt_tokens_details":null'
    else:
        created = b"null" if created_cache_tokens is None else b"%d" % created_cache_tokens
        out += (
            b',"prompt_tokens_details":{"cached_tokens":%d,"created_cache_tokens":%s,'
            b'"multimodal_tokens":null}' % (cached_tokens, created)
        )
    return out + b',"completion_tokens_details":null}'


class StreamWire:
    """The events of one streamed response. Build once per request; call per chunk."""

    __slots__ = (
        "_chat",
        "_head",
        "_head_json",
        "_ids",
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
        # The ids the choice would carry with `return_token_ids`: passed as null otherwise.
        self._ids = (
            b',"token_ids":null}]' if chat else b',"prompt_token_ids":null,"token_ids":null}]'
        )
        if chat:
            self._post = b'"},"logprobs":null,"finish_reason":null' + self._ids
        else:
            self._post = b'","logprobs":null,"finish_reason":null,"stop_reason":null' + self._ids
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
        """The role chunk: no token_ids in its choice, but the prompt's ids and text
        (null unless `return_token_ids` / `return_prompt_text`) after the usage."""
        return (
            self._head
            + b',"choices":[{"index":%d,"delta":{"role":"assistant","content":""},' % index
            + b'"logprobs":null,"finish_reason":null}]'
            + (b"" if usage is None else b',"usage":' + usage)
            + b',"prompt_token_ids":null,"prompt_text":null}\n\n'
        )

    def echo(self, text: bytes, usage: bytes | None = None, index: int = 0) -> bytes:
        """Chat's echo of the prompt's last message (`echo: true`), choice `index`'s: a
        content chunk without `token_ids` (vLLM builds its choice without them,
        chat_completion/serving.py, `if request.echo`); `text` already escaped."""
        return (
            self._head
            + self._opening(index)
            + text
            + b'"},"logprobs":null,"finish_reason":null}]'
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
        return b'"%s,"logprobs":null,"finish_reason":%s,"stop_reason":%s%s' % (
            b"}" if self._chat else b"",
            orjson.dumps(finish_reason),
            orjson.dumps(stop_reason),
            self._ids,
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
    fingerprint: str | None = None,
) -> bytes:
    """A non-streamed chat completion or text completion as vLLM 0.32 returns it: `n`
    choices, each with `text`, every field of the response model in its order, nulls
    included (`usage` from `full_usage_json`). Chat's message leaves out an empty
    `tool_calls` (ChatMessage._serialize); the rest are vLLM's fields this simulator has
    no values for (openai/chat_completion/protocol.py ChatCompletionResponse and
    ChatCompletionResponseChoice, openai/completion/protocol.py CompletionResponse and
    CompletionResponseChoice; tests/fixtures/streams/vllm-0.32/chat_nonstream_metrics.json
    and spec_completions_nonstream.json show them)."""
    choices: list[dict[str, Any]]
    if chat:
        message = {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                   "audio": None, "function_call": None, "reasoning": None}  # fmt: skip
        choices = [
            {
                "index": i,
                "message": message,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
                "token_ids": None,
                "routed_experts": None,
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
                "token_ids": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "routed_experts": None,
            }
            for i in range(n)
        ]
    body: dict[str, Any] = {
        "id": response_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": orjson.Fragment(usage),
    }
    if chat:
        body |= {"prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None}
    body |= {
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None if metrics is None else orjson.Fragment(metrics),
    }
    return orjson.dumps(body)
