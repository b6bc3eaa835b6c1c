"""Ollama's native API: `POST /api/chat`, `/api/generate` and `/api/embed`.

Wire facts (ollama/ollama @ fb30760: docs/api.md, api/types.go, server/routes.go):

- Streaming is the default (`Stream *bool`, "true by default"); `"stream": false` answers
  one `application/json; charset=utf-8` object. A stream is `application/x-ndjson`, one
  JSON object a line (streamResponse: json.Marshal + "\\n"; proxy/core/ndjson.py).
- Chat lines carry `message.content`, `message.thinking` and, whole, `message.tool_calls`;
  generate lines carry `response`, `thinking` and `tool_calls`. One line can carry the
  end of the thinking and the start of the answer: ChatHandler sets both
  `message.thinking` and `message.content` from one thinking-parser call
  (thinkingState.AddContent), which splits a chunk that holds the closing tag. Such a
  line is the first answer (or call) and one more reasoning event. `"done": false` until the
  last line, which has `"done": true`, `done_reason` and the `Metrics` (api/types.go):
  `prompt_eval_count`, `eval_count` and durations in nanoseconds (proxy/core/engine_ollama.py).
  All are `omitempty`: a zero count or duration is absent, and so is an empty done_reason.
- `done_reason` is "stop" or "length" from a generation (llm/server.go DoneReason.String),
  "load" for a generate with an empty prompt (the model is loaded, nothing generated) and
  "unload" for an empty prompt with keep_alive 0 (GenerateHandler). load/unload are not
  a stop: they map to `other`, and the raw value is kept.
- `prompt_eval_count` is the whole prompt: llm/llama_server.go promptEvalCount returns
  `CacheN + PromptN` (the tokens reused from the cache and those evaluated), so the usage
  source holds. Ollama does not say how many were cached.
- An error before anything was written is an HTTP status with `{"error": "..."}`
  (streamResponse: `if !c.Writer.Written() { c.JSON(status, gin.H{"error": e}) }`); after
  it, a line `{"error": "..."}` and the stream ends (json.NewEncoder(c.Writer).Encode).
  The texts behind not_found and context_length are in tests/fixtures/errors/index.toml.
- `/api/embed` answers `{"model", "embeddings", "total_duration", "load_duration",
  "prompt_eval_count"}` (EmbedResponse), never streamed.

Nothing is injected: Ollama always sends its counts, so the request goes as it came.

The proxy's own errors on Ollama's native paths (a 413, 408, 502 or 504 it answers itself,
measured route or passthrough: NATIVE_ROUTES) are `{"error": "..."}`, Ollama's StatusError (api/types.go:
its ErrorMessage has the tag `json:"error"`): its clients read that string (api/client.go
checkError unmarshals into StatusError; the `ollama` Python client's ResponseError takes
`["error"]`), and an OpenAI-shaped object there reaches them as a dict, not a message.
"""

from __future__ import annotations

from typing import Any, ClassVar

import orjson

from proxy.core.apis.base import (
    MALFORMED,
    NOTHING,
    Api,
    Facts,
    RequestInfo,
    TokenCounts,
    finite_float,
    json_text,
    sampling_options,
)
from proxy.core.engine import EngineMetrics
from proxy.core.engine_ollama import ollama_embed_engine, ollama_engine
from proxy.core.lax import lax_int
from proxy.core.measurement import TokenSource
from proxy.core.toolcalls import CallPiece

#: Ollama's native routes but the three measured here (server/routes.go GenerateRoutes:
#: every route but `/` and the OpenAI-compatible /v1 ones), and the paths below them:
#: `/api/blobs/:digest` (ollama create's uploads, HEAD then POST), `/api/user/keys/:key`.
#: The proxy's own errors there are Ollama's (proxy/core/errors.py error_shape); each is a
#: route label of its own (proxy/core/labels.py).
NATIVE_ROUTES = (
    "/api/embeddings",
    "/api/tags",
    "/api/ps",
    "/api/show",
    "/api/pull",
    "/api/push",
    "/api/create",
    "/api/copy",
    "/api/delete",
    "/api/blobs",
    "/api/version",
    "/api/status",
    "/api/me",
    "/api/signout",
    "/api/user/keys",
    "/api/experimental/web_search",
    "/api/experimental/web_fetch",
    "/api/experimental/model-recommendations",
)


def native_route(path: str) -> bool:
    """Whether `path` is one of NATIVE_ROUTES or below one."""
    return any(path == route or path.startswith(route + "/") for route in NATIVE_ROUTES)


#: Ollama's done_reason values onto the closed finish set; any other is `other`.
_FINISH = {"stop": "stop", "length": "length"}
#: api/types.go Metrics, and EmbedResponse's share of them: a generation's done object and
#: an embedding answer have some (total_duration always: time.Since(checkpointStart));
#: GenerateHandler's and ChatHandler's load and unload answers, and EmbedHandler's answer
#: to no input, have none (server/routes.go).
_METRICS = (
    "total_duration",
    "load_duration",
    "prompt_eval_count",
    "prompt_eval_duration",
    "eval_count",
    "eval_duration",
)
#: Shared answers for a line in the middle of a stream with content, nothing else.
_CONTENT = {name: Facts(content=name, plain=True) for name in ("text", "reasoning", "tool")}


class OllamaApi(Api):
    """What Ollama's native endpoints share: options, default streaming, counts, errors."""

    provider: ClassVar[str] = "ollama"
    error_shape = "ollama"
    stream_type: ClassVar[str] = "application/x-ndjson"
    ndjson: ClassVar[bool] = True
    end_marker: ClassVar[str] = 'a line with "done": true'
    #: Where a line's generated text sits: the chat message, or the generate body itself.
    message: ClassVar[bool] = True

    def read_request(self, obj: dict[str, Any]) -> RequestInfo:
        """The sampling options are in `options` (api/types.go Options: seed, top_k,
        top_p, stop, the penalties), the output type in `format` ("json" or a JSON
        schema); no `n`. Streaming unless `"stream": false`."""
        options = obj.get("options")
        options = options if type(options) is dict else {}
        model = obj.get("model")
        return RequestInfo(
            endpoint=self.endpoint,
            model=model if isinstance(model, str) else "",
            stream=self.generative and obj.get("stream") is not False,
            usage_requested=True,
            max_tokens=lax_int(self.max_tokens(obj)),
            temperature=finite_float(options.get("temperature")),
            prompt=self.prompt(obj),
            options=sampling_options(options, output=_format(obj.get("format")), choices=False)
            if self.generative
            else None,
        )

    def max_tokens(self, obj: dict[str, Any]) -> object:
        options = obj.get("options")
        return options.get("num_predict") if type(options) is dict else None

    def bench_body(
        self, model: str, prompt: Any, max_tokens: int, ignore_eos: bool
    ) -> dict[str, Any]:
        # Ollama has no ignore_eos; num_predict caps the length.
        key = "messages" if self.message else "prompt"
        return {
            "model": model,
            key: prompt,
            "stream": True,
            "options": {"num_predict": max_tokens, "temperature": 0},
        }

    def event(self, payload: bytes, collect: bool, identify: bool) -> Facts:
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return MALFORMED
        if type(obj) is not dict:
            return MALFORMED
        facts = self._facts(obj, collect)
        if obj.get("done") is True:
            facts.end = True
        elif (
            facts.error is None
            and facts.reasoning is None
            and facts.calls is None
            and not identify
            and not collect
        ):
            # a line in the middle: a shared answer, as chat's common event gets
            return NOTHING if facts.content is None else _CONTENT[facts.content]
        return facts

    def body(self, obj: dict[str, Any], collect: bool) -> Facts:
        """The whole non-streamed answer: a done line's fields, its content no event (it
        has no instant of its own: TTFT is for streams)."""
        facts = self._facts(obj, collect)
        facts.content = facts.reasoning = None
        return facts

    def _facts(self, obj: dict[str, Any], collect: bool) -> Facts:
        """One line, or the whole non-streamed answer: the same fields either way."""
        facts = Facts()
        holder = obj.get("message") if self.message else obj
        if type(holder) is dict:
            text, thinking = holder.get(self._text_key), holder.get("thinking")
            calls = holder.get("tool_calls")
            thought = thinking if thinking and type(thinking) is str else None
            if text and type(text) is str:
                facts.content = "text"
            elif calls and type(calls) is list:
                facts.content = "tool"
            elif thought:
                facts.content = "reasoning"
            if thought is not None and facts.content != "reasoning":  # thinking ended here
                facts.reasoning = [thought]
            if calls and type(calls) is list:
                facts.calls = _whole_calls(calls)
            if collect and facts.content is not None:
                facts.texts = [v for v in (thinking, text) if v and type(v) is str]
                if type(calls) is list:
                    facts.texts.extend(_call_texts(calls))
        error = obj.get("error")
        if error is not None:
            facts.error = error
        if obj.get("done") is True:
            reason = obj.get("done_reason")
            facts.finish = reason if reason and type(reason) is str else None
            facts.usage = obj
            facts.engine = obj
        model = obj.get("model")
        facts.response_id = ""  # Ollama's answers have no id
        facts.response_model = model if type(model) is str else None
        return facts

    @property
    def _text_key(self) -> str:
        return "content" if self.message else "response"

    def finish_label(self, raw: str) -> str:
        return _FINISH.get(raw, "other")

    def counts(self, usage: dict[str, Any]) -> TokenCounts | None:
        """prompt_eval_count and eval_count of the done object; absent is 0 (omitempty).

        An answer with none of the Metrics (_METRICS) evaluated nothing: the model was only
        loaded or unloaded (`ollama run`, `ollama stop`: cmd/cmd.go loadOrUnloadModel).
        It counts no tokens, not 0 of each, and nothing is left for a tokenizer or the
        chunks to count (TokenSource.NONE): the request is recorded, its tokens are not."""
        if not any(key in usage for key in _METRICS):
            return TokenCounts(prompt=None, output=None, cached=None, source=TokenSource.NONE)
        prompt = usage.get("prompt_eval_count", 0)
        output = usage.get("eval_count", 0) if self.generative else None
        if type(prompt) is not int or (self.generative and type(output) is not int):
            return None
        return TokenCounts(prompt=prompt, output=output, cached=None, source=TokenSource.USAGE)

    def engine_figures(self, obj: object) -> EngineMetrics | None:
        return ollama_engine(obj)


class OllamaChat(OllamaApi):
    endpoint = "/api/chat"
    paths = ("/api/chat",)
    operation = "chat"
    bench_name = "ollama-chat"
    takes_messages = True
    measures = (
        "TTFT at the first line with non-empty message.content, message.thinking or "
        "message.tool_calls; TPOT, ITL, decode speed; tokens from the done line's "
        "prompt_eval_count / eval_count (source usage); done_reason (load/unload: other); "
        "the engine's load_duration and prompt_eval_duration; error lines"
    )

    def prompt(self, obj: dict[str, Any]) -> Any:
        return obj.get("messages")


class OllamaGenerate(OllamaApi):
    endpoint = "/api/generate"
    paths = ("/api/generate",)
    operation = "text_completion"
    bench_name = "ollama-generate"
    message = False
    measures = (
        "TTFT at the first line with non-empty response, thinking or tool_calls; TPOT, "
        "ITL, decode speed; tokens from the done line's prompt_eval_count / eval_count "
        "(source usage); done_reason (load/unload: other); load_duration, "
        "prompt_eval_duration; error lines"
    )

    def prompt(self, obj: dict[str, Any]) -> Any:
        return obj.get("prompt")


class OllamaEmbed(OllamaApi):
    """Not streamed; its answer has the prompt's count and the load, no prefill time."""

    endpoint = "/api/embed"
    paths = ("/api/embed",)
    operation = "embeddings"
    generative = False
    measures = "e2e; prompt tokens from prompt_eval_count (source usage); load_duration"

    def body(self, obj: dict[str, Any], collect: bool) -> Facts:
        model = obj.get("model")
        if type(obj.get("embeddings")) is not list:
            return Facts(error=obj.get("error"))
        return Facts(
            usage=obj,
            engine=obj,
            response_id="",
            response_model=model if type(model) is str else None,
        )

    def engine_figures(self, obj: object) -> EngineMetrics | None:
        return ollama_embed_engine(obj)


def _format(value: object) -> dict[str, str] | None:
    """Ollama's `format` as a response format: "json", or a JSON schema (an object)."""
    if value == "json":
        return {"type": "json_object"}
    return {"type": "json_schema"} if isinstance(value, dict) else None


def _whole_calls(calls: list[Any]) -> tuple[CallPiece, ...] | None:
    """Each call of a line, or of the whole answer, whole, to be judged as a stream's calls
    are. Ollama sends a call once, when its parser has read it whole, its arguments an object
    (api/types.go ToolCall, ToolCallFunction; server/routes.go ChatHandler writes each parser
    call's calls on its own line): no call goes on over lines, so every call is a call of
    its own. Its number is its place in the line or answer. Neither `id` nor
    `function.index` tells calls apart: ids came with v0.12.10 (toolCallId), and the
    built-in parsers left the index 0 on every call (no omitempty) until v0.17.4 and
    v0.20.6 (model/parsers: "fix missing parallel tool call indices"). A later line's call
    with a number already closed is another call (proxy/core/toolcalls.py, ToolCalls.add)."""
    pieces = []
    for position, call in enumerate(calls):
        function = call.get("function") if type(call) is dict else None
        if type(function) is not dict:
            continue
        arguments = function.get("arguments")
        text = json_text(arguments) if type(arguments) is dict else ""
        pieces.append(CallPiece(position, True, text, closes=True))
    return tuple(pieces) or None


def _call_texts(calls: list[Any]) -> list[str]:
    """A tool call's name and arguments (Ollama sends arguments as an object)."""
    texts: list[str] = []
    for call in calls:
        function = call.get("function") if type(call) is dict else None
        if type(function) is dict:
            name, arguments = function.get("name"), function.get("arguments")
            if type(name) is str:
                texts.append(name)
            if arguments is not None:
                texts.append(json_text(arguments))
    return texts
