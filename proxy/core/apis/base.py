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
from proxy.core.lenient_json import Refusal, python_json_object, request_object
from proxy.core.llamacpp import first_task_prompt, first_task_times, several_tasks
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
ErrorShape = Literal["openai", "anthropic", "ollama"]


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
    #: The choices a stream owes before it may end on their finishes alone (an API whose
    #: stream has no end marker: llama.cpp's /completion runs a list of prompts one after
    #: another, and a stream cut between two of them has every finish it streamed).
    choices_due: int = 1
    #: Chat with `echo`: the content events a stream may open with that only give back the
    #: prompt's last message, one per choice (vLLM streams it as `delta.content` before
    #: any generated token): no output and no first token; 0 without echo.
    echo_events: int = 0
    #: The text each of those events gives back (proxy/core/apis/chat.py `echo_text`): an
    #: event is an echo only when its text is this one, as a backend that does not echo
    #: (llama-server) streams its first token there instead.
    echo_text: str | None = None
    #: The request's chat template options, as vLLM passes them to the template (tools,
    #: add_generation_prompt, continue_final_message, chat_template_kwargs), for a
    #: tokenizer's count of the prompt; None when it has none.
    template: dict[str, Any] | None = None
    #: The prompt's message digests once taken (proxy/core/fingerprint.py `chain_of`), so
    #: the record's prefix reuses the conversation table's hashing of the same messages.
    digests: Any = field(default=None, compare=False, repr=False)
    #: The sampling and output options the request names (the span's gen_ai.request.*
    #: attributes), None when it names none.
    options: RequestOptions | None = None
    #: The system instructions the request supplies apart from its messages (Anthropic
    #: `system`, Responses `instructions`), as sent. `prompt` begins with them as a system
    #: message (what a tokenizer counts and the fingerprint hashes); the span has them as
    #: gen_ai.system_instructions instead.
    system: Any = None
    #: The backend generates apart from the answer: a background Response (vLLM runs it
    #: in a task of its own, openai/responses/serving.py:537-589), streamed or not. An
    #: answer that ends before the response does (the acknowledgement `queued`, a stream
    #: its client left) leaves its tokens to the first retrieval that sees it finished
    #: (proxy/core/background.py).
    detached: bool = False


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """A request's sampling and output options, read laxly as max_tokens and temperature
    are (None: not in the request, or no value vLLM takes)."""

    seed: int | None = None
    choices: int | None = None  # `n`: the candidate completions asked for
    # llama-server's reading of them, on whichever route: `n_cmpl`, else its alias `n`
    # (tools/server/server-schema.cpp:62-64, `add_alias("n")`): the tasks it runs a prompt
    # where it answers, which no other server reads (`sampling_options`)
    llama_choices: int | None = None
    top_p: float | None = None
    top_k: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stop_sequences: tuple[str, ...] | None = None
    output_type: str | None = None  # gen_ai.output.type: "json" or "text"
    encoding_formats: tuple[str, ...] | None = None  # embeddings: the formats asked for
    dimensions: int | None = None  # embeddings: the output dimensions asked for


@dataclass(slots=True)
class TokenCounts:
    prompt: int | None
    output: int | None
    cached: int | None  # prompt tokens served from the prefix cache (among `prompt`)
    source: TokenSource
    # prompt tokens written to the prefix cache (among `prompt`): usage's, never guessed
    cache_write: int | None = None


#: (prompt tokens, cached ones among them, ones written to the cache among them), each
#: None where usage does not say (`Api.prompt_counts`).
PromptCounts = tuple[int | None, int | None, int | None]


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
    fingerprint  the `system_fingerprint` string as sent (OpenAI's chat and completions),
              read only from the event that carries usage or a finish reason, or from the
              body: vLLM 0.32 writes it on the terminal chunk, or with include_usage on the
              usage chunk (proxy/core/strip.py, MOVED)
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

    held      an engine output that streamed no content: vLLM sends a chunk for every
              engine output of a choice, with an empty delta (`"content": ""`, an empty
              `text`) while it holds the text back (incomplete UTF-8, a pending stop
              string, a parser's control token) and for the EOS with the finish: counted
              as output where nothing counts tokens, never a first token
    held_reasoning  a held output that was a reasoning token: vLLM's `"reasoning": ""`
              delta, its parser still in the reasoning (deepseek_r1's
              extract_reasoning_streaming returns `DeltaMessage(reasoning=delta_text)` for
              an empty text), with no finish or `length` (a token cut by the limit); any
              other finish rides on the EOS, which is output and no reasoning

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
    held: bool = False
    held_reasoning: bool = False
    fingerprint: str | None = None


#: Shared "nothing here" answer: never mutated, so one instance serves every event.
NOTHING = Facts()
MALFORMED = Facts(malformed=True)
END = Facts(end=True)
HELD = Facts(held=True)
HELD_REASONING = Facts(held=True, held_reasoning=True)


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
    #: The request's choices are llama-server's `n_cmpl` before `n`: an API only llama-server
    #: serves (its native /completion). Elsewhere `n` is the choices asked for, whatever
    #: server answers (vLLM ignores `n_cmpl`).
    reads_n_cmpl: ClassVar[bool] = False

    # -- the request ------------------------------------------------------------------

    def decode(self, body: bytes, content_type: bytes) -> dict[str, Any] | Refusal | None:
        """The request body as an object (JSON unless the API says otherwise), or None
        when it is not one (the request is then measured as a malformed one), or a
        Refusal saying whether `decode_leniently` may still read it."""
        return request_object(body)

    def decode_leniently(self, body: bytes, content_type: bytes) -> dict[str, Any] | None:
        """What `decode` refused, as the backend's reader may still take it
        (`python_json_object`), or None."""
        return python_json_object(body)

    def read_request(self, obj: dict[str, Any]) -> RequestInfo:
        """The request as RequestInfo; a generative API's options by their chat and
        completions names (vLLM's ChatCompletionRequest and CompletionRequest), a
        non-generative one's encoding_format and dimensions. An API whose names differ
        reads them itself and calls `request_info`."""
        if self.generative:
            options = sampling_options(
                obj, output=obj.get("response_format"), n_cmpl=self.reads_n_cmpl
            )
        else:
            options = embedding_options(obj)
        return request_info(self, obj, options)

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
        """Facts from a non-streaming success body (already parsed). llama-server's answer
        of several tasks carries the first task's counts alone (`several_tasks`): only its
        prompt is the request's."""
        usage = obj.get("usage")
        usage = usage if type(usage) is dict else None
        timings = obj.get("timings")
        if timings is not None and several_tasks(obj):
            usage, timings = first_task_prompt(usage), first_task_times(timings)
        return Facts(
            usage=usage,
            engine=obj.get("metrics"),
            timings=timings,
            fingerprint=fingerprint(obj),
            **identity(obj),
        )

    def answered(self, obj: dict[str, Any]) -> bool:
        """Whether a non-streaming body carries an answer's text (beside any reasoning and
        tool calls): a body of reasoning alone spent every output token on it, as a
        stream of reasoning alone did (observe.py, `only_reasoned`). An API that cannot
        tell says it did."""
        return True

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
        """Token counts from a usage object (OpenAI shape), None when it has none or is a
        `placeholder`."""
        output = usage.get("completion_tokens")
        if type(output) is not int or placeholder(usage):
            return None
        prompt, cached, written = self.prompt_counts(usage)
        return TokenCounts(prompt, output, cached, TokenSource.USAGE, written)

    def prompt_counts(self, usage: dict[str, Any]) -> PromptCounts:
        """(prompt tokens, cached ones among them, ones written to the cache among them) a
        usage object reports, with or without the output's count (OpenAI shape). vLLM
        0.32 with --enable-prompt-tokens-details: `prompt_tokens_details` {cached_tokens,
        created_cache_tokens, multimodal_tokens} (serve/engine/protocol.py
        PromptTokenUsageInfo); chat sets `created_cache_tokens`
        (chat_completion/serving.py, _make_prompt_tokens_details), completions and
        generate never do (null or absent: None here). OpenAI's own chat names them
        `cache_write_tokens` (openai-python types/completion_usage.py). A `placeholder`
        reports none."""
        if placeholder(usage):
            return None, None, None
        prompt = as_int(usage.get("prompt_tokens"))
        details = usage.get("prompt_tokens_details")
        if type(details) is not dict:
            return prompt, None, None
        written = as_int(details.get("created_cache_tokens"))
        if written is None:
            written = as_int(details.get("cache_write_tokens"))
        return prompt, as_int(details.get("cached_tokens")), written


def request_info(
    api: Api,
    obj: dict[str, Any],
    options: RequestOptions | None,
    system: Any = None,
    previous_response_id: str | None = None,
) -> RequestInfo:
    """`Api.read_request`'s RequestInfo, with the options, system instructions and previous
    response an API reads its own way (one construction: `dataclasses.replace` costs
    microseconds)."""
    model = obj.get("model")
    return RequestInfo(
        endpoint=api.endpoint,
        model=model if isinstance(model, str) else "",
        stream=lax_bool(obj.get("stream")) is True,  # as vLLM reads it: "true" streams
        usage_requested=api.usage_requested(obj),
        max_tokens=lax_int(api.max_tokens(obj)),  # as vLLM reads them: "16" is 16
        temperature=finite_float(obj.get("temperature")),
        prompt=api.prompt(obj),
        template=api.template(obj),
        previous_response_id=previous_response_id,
        options=options,
        system=system,
    )


def gen_ai_message(item: dict[str, Any]) -> dict[str, Any]:
    """One chat-like message ({"role", "content"}) as a GenAI {"role", "parts"} message.

    Tool calls and their results become the schema's `tool_call` {id, name, arguments} and
    `tool_call_response` {id, response} parts (semantic-conventions-genai
    docs/gen-ai/gen-ai-input-messages.json @ b49cb9d3, ToolCallRequestPart and
    ToolCallResponsePart), from each shape: an OpenAI assistant message's `tool_calls` and a
    `tool` message's `tool_call_id`; Anthropic `tool_use` and `tool_result` blocks;
    Responses `function_call` and `function_call_output` items. Arguments as sent."""
    kind = item.get("type")
    if kind == "function_call":  # a Responses input item, no role
        call = {"type": "tool_call", "id": item.get("call_id"), "name": item.get("name")}
        return {"role": "assistant", "parts": [{**call, "arguments": item.get("arguments")}]}
    if kind == "function_call_output":
        response = {"type": "tool_call_response", "id": item.get("call_id")}
        return {"role": "tool", "parts": [{**response, "response": item.get("output")}]}
    content = item.get("content")
    role = str(item.get("role", "user"))
    parts: list[dict[str, Any]] = []
    if role == "tool":
        response = {"type": "tool_call_response", "id": item.get("tool_call_id")}
        return {"role": role, "parts": [{**response, "response": _text(content)}]}
    if isinstance(content, str):
        parts.append({"type": "text", "content": content})
    elif isinstance(content, list):
        for part in content:
            if not isinstance(part, dict):
                continue
            kind = part.get("type")
            if kind == "text":
                parts.append({"type": "text", "content": part.get("text", "")})
            elif kind == "tool_use":
                call = {"type": "tool_call", "id": part.get("id"), "name": part.get("name")}
                parts.append({**call, "arguments": part.get("input")})
            elif kind == "tool_result":
                response = {"type": "tool_call_response", "id": part.get("tool_use_id")}
                parts.append({**response, "response": _text(part.get("content"))})
            else:
                parts.append({"type": str(kind or "unknown")})  # no media payloads
    calls = item.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                part = {"type": "tool_call", "id": call.get("id"), "name": function.get("name")}
                parts.append({**part, "arguments": function.get("arguments")})
    return {"role": role, "parts": parts}


def _text(content: object) -> object:
    """A tool result's content: a text as it is, a list of parts as their texts joined (no
    media payloads)."""
    if not isinstance(content, list):
        return content
    return "".join(
        p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
    )


def finite_float(value: object) -> float | None:
    """A float field as vLLM reads it, None where it is no finite number."""
    number = lax_float(value)
    return number if number is None or math.isfinite(number) else None


#: Every name `sampling_options` reads, of every API.
_SAMPLING = frozenset(
    {"seed", "n", "n_cmpl", "top_p", "top_k", "frequency_penalty", "presence_penalty", "stop",
     "stop_sequences"}
)  # fmt: skip


def sampling_options(
    obj: dict[str, Any],
    *,
    output: object,
    stop: str = "stop",
    choices: bool = True,
    n_cmpl: bool = False,
    seed: bool = True,
    penalties: bool = True,
) -> RequestOptions | None:
    """The sampling options a request names, by chat's names (seed, n, top_p, top_k,
    frequency_penalty, presence_penalty, stop) less those its API lacks, and the output
    type of its response format `output`; None when it names none (a few look-ups).
    `n_cmpl`: the API is llama-server's own, whose choices are `n_cmpl` before `n`;
    elsewhere they are `n`, and `n_cmpl` only llama-server's reading (`llama_choices`)."""
    if output is None and _SAMPLING.isdisjoint(obj):  # most requests: one pass over its keys
        return None
    get = obj.get
    n = cmpl = None
    if choices:
        n, cmpl = get("n"), get("n_cmpl")
    # llama-server reads `n` only as n_cmpl's fallback (tools/server/server-schema.cpp:62-64,
    # `add_alias("n")`), on every route it serves; no other server has it
    llama = n if cmpl is None else cmpl
    values = (
        get("seed") if seed else None,
        llama if n_cmpl else n,
        get("top_p"),
        get("top_k"),
        get("frequency_penalty") if penalties else None,
        get("presence_penalty") if penalties else None,
        get(stop),
        output,
    )
    if llama is None and values.count(None) == len(values):
        return None
    return RequestOptions(
        seed=lax_int(values[0]),
        choices=lax_int(values[1]),
        llama_choices=lax_int(llama),
        top_p=finite_float(values[2]),
        top_k=lax_int(values[3]),
        frequency_penalty=finite_float(values[4]),
        presence_penalty=finite_float(values[5]),
        stop_sequences=stop_sequences(values[6]),
        output_type=output_type(output),
    )


def embedding_options(obj: dict[str, Any]) -> RequestOptions | None:
    """An embeddings request's encoding_format and dimensions, None without either."""
    formats, dimensions = obj.get("encoding_format"), obj.get("dimensions")
    if formats is None and dimensions is None:
        return None
    return RequestOptions(
        encoding_formats=(formats,) if isinstance(formats, str) else None,
        dimensions=lax_int(dimensions),
    )


def stop_sequences(value: object) -> tuple[str, ...] | None:
    """A stop field (a text or a list of texts) as gen_ai.request.stop_sequences."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    return None


#: The response formats that ask for JSON ("JSON object with known or unknown schema":
#: docs/gen-ai/client-inference.md @ 024a4f94); any other one (text, vLLM's structural_tag)
#: asks for text.
_JSON_FORMATS = frozenset({"json_object", "json_schema"})


def output_type(value: object) -> str | None:
    """gen_ai.output.type of a response format ({"type": ...}), None when the request
    names none: Conditionally Required "when applicable and if the request includes an
    output format" (docs/gen-ai/client-inference.md @ 024a4f94, note 6)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(kind, str):
        return None
    return "json" if kind in _JSON_FORMATS else "text"


#: The longest `system_fingerprint` kept: vLLM's is `vllm-<version>-<hash>`; a longer one
#: (a broken or hostile backend's) would go whole into every log line and span.
MAX_FINGERPRINT = 256


def fingerprint(obj: dict[str, Any]) -> str | None:
    """A response's `system_fingerprint`, None when it has none (or not a string: vLLM's
    --fingerprint-mode none writes null), or one longer than MAX_FINGERPRINT."""
    value = obj.get("system_fingerprint")
    return value if type(value) is str and len(value) <= MAX_FINGERPRINT else None


def identity(obj: dict[str, Any]) -> dict[str, Any]:
    """response_id ("" when absent, so it is looked for only once) and response_model."""
    rid, model = obj.get("id"), obj.get("model")
    return {
        "response_id": rid if type(rid) is str else "",
        "response_model": model if type(model) is str else None,
    }


def json_text(value: object) -> str:
    """`value` written as JSON text (a call's arguments sent as an object), "" when orjson
    cannot write it: it reads deeper nesting than it writes, and an answer's odd value
    must not break its measuring."""
    try:
        return orjson.dumps(value).decode()
    except (orjson.JSONEncodeError, TypeError):
        return ""


def as_int(value: object) -> int | None:
    return value if type(value) is int else None


def placeholder(usage: dict[str, Any]) -> bool:
    """A usage object of 0 prompt and 0 completion tokens: a place kept for a count, not
    one. No real prompt is 0 tokens (vLLM 0.32 refuses an empty one:
    vllm/v1/engine/input_processor.py `_validate_prompt_len`, "The decoder prompt cannot
    be empty"). Ollama's OpenAI layer, asked for include_usage, writes it on every
    /v1/completions chunk (ollama/ollama @ fb30760 middleware/openai.go
    CompleteWriter.writeResponse, `c.Usage = &openai.Usage{}`) and the real usage only on
    a chunk after the last, so a stream cut before that one has no count: it is counted as
    a stream without usage is. vLLM's continuous_usage_stats chunks carry the real prompt
    from the first one on."""
    return as_int(usage.get("prompt_tokens")) == 0 and as_int(usage.get("completion_tokens")) == 0
