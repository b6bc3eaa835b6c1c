"""What every API seam provides, and the small records that cross the seam.

An `Api` is one object per wire format (chat completions, Anthropic Messages, ...). The
relay asks it whether and how to change the request (usage injection), the observer hands
it each streamed event and each non-streaming body and gets back `Facts`: plain data, no
API knowledge left on the other side. Subclasses override only what differs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import orjson

from proxy.core.engine import EngineMetrics, engine_metrics
from proxy.core.lax import lax_bool, lax_float, lax_int
from proxy.core.measurement import NONE_LABEL, TokenSource
from proxy.core.ndjson import NDJSONDecoder
from proxy.core.sse import SSEDecoder
from proxy.core.toolcalls import CallPiece

#: The closed finish_reason label set. Raw backend values are mapped onto it by each Api
#: and kept as they came in `Measurement.raw_finish_reason` (logs and spans).
FINISH_LABELS = frozenset(
    {
        "stop",
        "length",
        "tool_calls",
        "function_call",
        "content_filter",
        "abort",
        "error",
        "repetition",
        "other",
        NONE_LABEL,
    }
)


#: The error body shapes the proxy writes its own errors in (proxy/core/errors.py error_body).
ErrorShape = Literal["openai", "anthropic"]


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What the proxy needs to know about a client's request, read once from its body."""

    endpoint: str  # the Api's label (its canonical path)
    model: str  # "" when absent or not a string
    stream: bool
    usage_requested: bool  # the client itself asked for streamed usage (or the API always sends it)
    max_tokens: int | None
    temperature: float | None
    prompt: Any = None  # what a tokenizer would count as the prompt (messages, prompt, input)
    valid_json: bool = True
    prompt_tokens: int | None = None  # known exactly from the request (token ids sent)
    previous_response_id: str | None = None  # Responses: the response this one continues
    #: Completions with `echo`: the prompt each choice's text begins with, by choice index
    #: (what a tokenizer's count of the output leaves out); empty without echo.
    echoed: tuple[Any, ...] = ()
    #: The request's chat template options, as vLLM passes them to the template (tools,
    #: add_generation_prompt, continue_final_message, chat_template_kwargs), for a
    #: tokenizer's count of the prompt; None when it has none.
    template: dict[str, Any] | None = None
    #: The prompt's message digests once taken (proxy/core/fingerprint.py `chain_of`), so
    #: the record's prefix reuses the conversation table's hashing of the same messages.
    digests: Any = field(default=None, compare=False, repr=False)


@dataclass(slots=True)
class TokenCounts:
    prompt: int | None
    output: int | None
    cached: int | None
    source: TokenSource


@dataclass(slots=True)
class Facts:
    """What one event (or one non-streaming body) says. Every field is optional.

    content   the kind of generated content it carries ("text", "reasoning", "tool"),
              None when it carries none (role-only chunks, start events, pings)
    choices   the choice indices the content belongs to (n > 1 chat/completions)
    texts     the generated text pieces, only when the observer collects them
    finish    the raw finish/stop reason, as the backend wrote it
    finish_choice  the index of the choice it finishes (n > 1: each choice finishes alone)
    finishes  a non-streaming body's raw finish reason per choice index (n > 1), None when
              it has one choice or none: a body ends every choice at once
    usage     the usage object as sent
    error     an in-stream error object (or the error event itself)
    engine    the engine's per-request `metrics` object as sent (proxy/core/engine.py),
              read only from the event or body that carries usage
    timings   llama.cpp's `timings` object as sent (proxy/core/llamacpp.py), read only from
              the event that carries usage or a finish reason, or from the body
    end       the event ends the stream cleanly ([DONE], message_stop, response.completed)
    tokens    output tokens the event carries exactly (token-in/token-out `token_ids`), 0
              when the API does not say
    calls     the tool-call pieces the event carries (proxy/core/toolcalls.py), None when
              none: only tool-call events have them, so only such streams pay for them
    reasoning the reasoning an answer or tool-call event also carries, None when none: the
              last of the reasoning and the first of the answer in one event, when the
              closing tag fell inside one delta (vLLM's reasoning parsers then return both,
              vllm/reasoning/deepseek_r1_reasoning_parser.py and basic_parsers.py,
              extract_reasoning_streaming; Ollama's ChatHandler sets message.thinking and
              message.content from one thinking-parser call, server/routes.go)

    An Api may answer with a shared instance (NOTHING, or a common content event): a
    Facts is read, never changed, by whoever did not create it.
    """

    content: str | None = None
    choices: tuple[int, ...] = (0,)
    texts: list[str] | None = None
    finish: str | None = None
    finish_choice: int = 0
    finishes: dict[int, str] | None = None
    usage: dict[str, Any] | None = None
    error: object = None
    engine: object = None
    end: bool = False
    response_id: str | None = None
    response_model: str | None = None
    malformed: bool = False
    tokens: int = 0
    plain: bool = False  # content of choice 0 and nothing else: the observer's fast path
    calls: tuple[CallPiece, ...] | None = None
    timings: object = None  # llama.cpp's `timings` object as sent (proxy/core/llamacpp.py)
    reasoning: list[str] | None = None


#: Shared "nothing here" answer: never mutated, so one instance serves every event.
NOTHING = Facts()
MALFORMED = Facts(malformed=True)
END = Facts(end=True)


def json_object(payload: bytes) -> dict[str, Any] | None:
    """One event's payload as a JSON object, or None when it is not one (MALFORMED)."""
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    return obj if type(obj) is dict else None


class Api:
    """The base seam. Class attributes name the API; methods read its wire format."""

    #: Label value of the `endpoint` metric label: the canonical path.
    endpoint: ClassVar[str] = ""
    #: Every path served by this API (normalised, no query), the label's path first.
    paths: ClassVar[tuple[str, ...]] = ()
    #: Whether the API generates tokens (TTFT, TPOT, output tokens make sense).
    generative: ClassVar[bool] = True
    #: GenAI semantic conventions: gen_ai.operation.name and gen_ai.provider.name.
    operation: ClassVar[str] = "chat"
    provider: ClassVar[str] = "openai"
    #: The `tokenprobe bench --endpoint` choice that measures this API ("" when the bench
    #: has none), and whether its prompt is a chat `messages` list (else a text).
    bench_name: ClassVar[str] = ""
    takes_messages: ClassVar[bool] = False
    #: The shape of the proxy's own error bodies for this API's clients (and for requests
    #: to paths under its own, such as /v1/messages/count_tokens): what their SDKs parse.
    error_shape: ClassVar[ErrorShape] = "openai"
    #: What is missing when a stream ends without its clean end (for the error message).
    end_marker: ClassVar[str] = "its end event"
    #: A finish reason alone ends a stream cleanly (OpenAI streams may omit [DONE]).
    finish_ends_stream: ClassVar[bool] = False
    #: What is measured, and the instants used: docs/reference/apis.md (docs/generate.py).
    measures: ClassVar[str] = ""
    #: The bytes that open a plain content event's text (`"content":"`): where the
    #: observer may split a stream's repeating event (proxy/core/template.py). Empty: never.
    text_openings: ClassVar[tuple[bytes, ...]] = ()
    #: The content type of this API's streamed answers (a prefix), and its framing: SSE
    #: `data:` events, or one JSON object a line (Ollama's application/x-ndjson).
    stream_type: ClassVar[str] = "text/event-stream"
    ndjson: ClassVar[bool] = False
    #: Backend kinds (proxy/core/identity.py) whose streams change beyond the usage event
    #: when asked for usage: the proxy never asks them for it (the client's bytes would differ).
    usage_reshapes: ClassVar[frozenset[str]] = frozenset()

    # -- the request ------------------------------------------------------------------

    def decode(self, body: bytes, content_type: bytes) -> dict[str, Any] | None:
        """The request body as an object (JSON unless the API says otherwise), or None
        when it is not one (the request is then measured as a malformed one)."""
        return json_object(body)

    def read_request(self, obj: dict[str, Any]) -> RequestInfo:
        model = obj.get("model")
        temperature = lax_float(obj.get("temperature"))  # as vLLM reads them: "16" is 16
        max_tokens = lax_int(self.max_tokens(obj))
        return RequestInfo(
            endpoint=self.endpoint,
            model=model if isinstance(model, str) else "",
            stream=lax_bool(obj.get("stream")) is True,  # as vLLM reads it: "true" streams
            usage_requested=self.usage_requested(obj),
            max_tokens=max_tokens,
            temperature=temperature if temperature is None or math.isfinite(temperature) else None,
            prompt=self.prompt(obj),
            template=self.template(obj),
        )

    def template(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """The request's chat template options (RequestInfo.template), None without any."""
        return None

    def max_tokens(self, obj: dict[str, Any]) -> object:
        return obj.get("max_tokens")

    def prompt(self, obj: dict[str, Any]) -> Any:
        return obj.get("input")

    def input_messages(self, prompt: Any) -> list[dict[str, Any]] | None:
        """The prompt (RequestInfo.prompt) as GenAI `gen_ai.input.messages`: one
        {"role", "parts"} per chat-like message, text parts with their text, other parts by
        type only (no media payloads). None when the prompt is no list of messages."""
        if not isinstance(prompt, list):
            return None
        return [gen_ai_message(item) for item in prompt if isinstance(item, dict)]

    def bench_body(
        self, model: str, prompt: Any, max_tokens: int, ignore_eos: bool
    ) -> dict[str, Any]:
        """The request body `tokenprobe bench` sends this API for a prompt (a text or a
        `messages` list, as `takes_messages` says): streamed, with usage wherever the API
        can be asked for it. The default is the chat and completions body."""
        body: dict[str, Any] = {
            "model": model,
            "messages" if isinstance(prompt, list) else "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if ignore_eos:
            body["ignore_eos"] = True
        return body

    def usage_requested(self, obj: dict[str, Any]) -> bool:
        """True when the backend will send usage without the proxy asking for it."""
        return True

    def ask_for_usage(self, obj: dict[str, Any], body: bytes) -> bytes | None:
        """The request body (`obj` parsed from `body`) asking the backend for usage, or None
        when this API has no way to (or no need). The relay then strips what the client did
        not ask for."""
        return None

    # -- the response -----------------------------------------------------------------

    def decoder(self, max_event_bytes: int) -> SSEDecoder | NDJSONDecoder:
        """A fresh decoder of this API's stream framing: bytes in, event payloads out."""
        if self.ndjson:
            return NDJSONDecoder(max_event_bytes)
        return SSEDecoder(max_event_bytes)

    def engine_figures(self, obj: object) -> EngineMetrics | None:
        """The engine adapter: the engine's own per-request object (Facts.engine) as
        figures in seconds. vLLM's `metrics` object unless the API's engine says otherwise
        (proxy/core/engine_ollama.py)."""
        return engine_metrics(obj)

    def event(self, payload: bytes, collect: bool, identify: bool) -> Facts:
        """Facts from one SSE `data` payload. `collect`: keep the generated text pieces
        (for a tokenizer); `identify`: read the response id and model (until one is seen)."""
        return NOTHING

    def body(self, obj: dict[str, Any], collect: bool) -> Facts:
        """Facts from a non-streaming success body (already parsed)."""
        usage = obj.get("usage")
        return Facts(
            usage=usage if type(usage) is dict else None,
            engine=obj.get("metrics"),
            timings=obj.get("timings"),
            **identity(obj),
        )

    def finish_label(self, raw: str) -> str:
        """The closed-set label for a raw finish/stop reason."""
        return raw if raw in FINISH_LABELS else "other"

    def merge_usage(self, old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
        """Usage seen twice in one stream: the later one wins unless an API says otherwise."""
        return new

    def reasoning_tokens(self, usage: dict[str, Any]) -> int | None:
        """The reasoning tokens a usage object reports (OpenAI shape:
        `completion_tokens_details.reasoning_tokens`), None when it says nothing."""
        details = usage.get("completion_tokens_details")
        return as_int(details.get("reasoning_tokens")) if type(details) is dict else None

    def counts(self, usage: dict[str, Any]) -> TokenCounts | None:
        """Token counts from a usage object (OpenAI shape), None when it has none."""
        output = usage.get("completion_tokens")
        if type(output) is not int:
            return None
        prompt, cached = self.prompt_counts(usage)
        return TokenCounts(prompt=prompt, output=output, cached=cached, source=TokenSource.USAGE)

    def prompt_counts(self, usage: dict[str, Any]) -> tuple[int | None, int | None]:
        """(prompt tokens, cached ones among them) a usage object reports, with or without
        the output's count (OpenAI shape)."""
        prompt = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if type(details) is dict else None
        return prompt if type(prompt) is int else None, cached if type(cached) is int else None


def gen_ai_message(item: dict[str, Any]) -> dict[str, Any]:
    """One chat-like message ({"role", "content"}) as a GenAI {"role", "parts"} message."""
    content = item.get("content")
    parts: list[dict[str, Any]] = []
    if isinstance(content, str):
        parts.append({"type": "text", "content": content})
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append({"type": "text", "content": part.get("text", "")})
            elif isinstance(part, dict):
                parts.append({"type": str(part.get("type", "unknown"))})  # no media payloads
    return {"role": str(item.get("role", "user")), "parts": parts}


def identity(obj: dict[str, Any]) -> dict[str, Any]:
    """response_id ("" when absent, so it is looked for only once) and response_model."""
    rid, model = obj.get("id"), obj.get("model")
    return {
        "response_id": rid if type(rid) is str else "",
        "response_model": model if type(model) is str else None,
    }


def as_int(value: object) -> int | None:
    return value if type(value) is int else None
