"""One request's plan: what the simulator will send, decided before it sends anything.

Inputs are the JSON body, the request headers and the `SimConfig`. Per-request
headers (the openai SDK sends them with `extra_headers`) override the config:

  x-sim-ttft                 seconds from request received to the first content token
  x-sim-ttft-per-prompt-token  seconds added to the TTFT per prompt token (prefill)
  x-sim-tps                  tokens per second after the first (free-running mode)
  x-sim-output-tokens        planned completion length in text tokens; an EOS token
                             follows (finish "stop"), counted in usage as vLLM counts it
  x-sim-tokens-per-chunk     tokens per content chunk (default 1); chunks come every
                             tokens_per_chunk / tps seconds, so tps stays tokens/s
  x-sim-metrics: 1           vLLM's per-request `metrics` object (SimConfig.per_request_metrics)
  x-sim-spec-tokens          speculative decoding: drafts per step (SimConfig.spec_tokens)
  x-sim-acceptance-rate      share of drafts accepted; chunks carry round(rate * k) + 1
                             tokens (overrides x-sim-tokens-per-chunk)
  x-sim-finish-reason        force the finish_reason sent (stop, length, tool_calls, ...)
  x-sim-cached-tokens        prompt tokens reported as cached (capped at the prompt):
                             prompt_tokens_details.cached_tokens (chat, completions),
                             input_tokens_details.cached_tokens (Responses),
                             cache_read_input_tokens (Messages)
  x-sim-cpu-per-token-us     busy-loop CPU per generated token, in microseconds
  x-sim-error                an error instead of a response: see errors.FORCED_ERRORS
  x-sim-fault                a fault in a 200 stream: see FAULTS (streaming only)
  x-sim-fault-after          content tokens sent before the fault fires (default 0)
  x-sim-stall                seconds of silence for the `stall` fault (default 1)
  x-sim-huge-bytes           size of the `huge_event` event (default 4 MiB)
  x-sim-stall-before-headers seconds to wait before the status line (any response)
  x-sim-no-done: 1           never send `data: [DONE]`
  x-sim-usage-mode           when `stream_options.include_usage` asks for usage:
                             separate (vLLM, default): a last chunk with "choices": [];
                             last_chunk: on the finish chunk; ignore: never streamed;
                             zeroed (Ollama's /v1/completions, middleware/openai.go
                             CompleteWriter): every content chunk carries an all-zero
                             usage, then the usage chunk
  x-sim-stamp: 1             stamp content chunks with "sent_ns" (as SimConfig.stamp);
                             `text`: their text starts with "@<time_ns> " instead
                             (as SimConfig.stamp_in_text)
  x-sim-ping: 1              Messages: an `event: ping` right after message_start
                             (Anthropic's API sends one; vLLM does not)
  x-sim-early-role: 1        chat's role-only chunks, Messages' message_start and Cohere's
                             message-start with the headers, at t~0, not with the first
                             token as vLLM sends them (proxy/sim/stream.py, events.py):
                             the shape that shows a proxy taking the first chunk for the
                             first token; `0` turns SimConfig.early_role off
  x-sim-reasoning-tokens, x-sim-reasoning-usage, x-sim-tool-calls,
  x-sim-invalid-tool-calls, x-sim-tool-call-argument-bytes, x-sim-merged-boundaries
                             reasoning and tool calls (chat, Messages, Responses, Cohere,
                             streamed): see proxy/sim/agentic.py; x-sim-output-tokens is
                             then the answer's length
  x-sim-incomplete-event: 1  Responses: end a cut-short response with
                             `response.incomplete` (OpenAI's API) instead of vLLM's
                             `response.completed` carrying status "incomplete"
  x-sim-backend-kind         chat and completions in this backend's shapes (BACKEND_KINDS;
                             SimConfig.backend_kind): llamacpp is llama-server's chunks and
                             `timings` (proxy/sim/llamacpp.py; x-sim-usage-mode and
                             continuous usage do not apply there), and it opens the
                             native /completion (proxy/sim/llamacpp_native.py)

Faults: error_event (vLLM's `data: {"error": {...}}` then [DONE]), error_string
(`data: {"error": "<text>"}` then [DONE]), reset (connection dropped mid-body),
close_no_done (body ends cleanly, no finish chunk, no [DONE]) end the stream; stall,
malformed (`data: {not json`), non_utf8 (a content chunk whose text is the raw bytes
ff fe) and huge_event (an extra valid content chunk of exactly x-sim-huge-bytes bytes,
text "xxx...") are inserted and the stream then goes on. `stream_options.
continuous_usage_stats` puts usage on every chunk, as in vLLM.

Output length: the planned length, cut to `max_completion_tokens`/`max_tokens` (Messages:
`max_tokens`, required; Responses: `max_output_tokens`) or, when none is given, to what
the context has left, with finish_reason "length". The EOS after the text is a token too
(`Plan.eos`): a text that leaves it no room under the limit ends with "length".
`ignore_eos` generates exactly up to that limit, as vLLM does.

Choices: chat's and completions' `n` (read and checked as vLLM does: 1 to
VLLM_MAX_N_SEQUENCES, and 1 at temperature 0) makes that many choices of the same text. They decode together: each
pacer slot carries one chunk per choice (stream.py).

Stop strings: chat's and completions' `stop` (and `include_stop_str_in_output`), and the
Messages and Cohere routes' `stop_sequences` (which vLLM hands to chat as `stop`), end the
programmed text where one first completes, with finish_reason "stop" and the string as
`stop_reason`; streamed text is held back as vLLM holds it (proxy/sim/stops.py). Playing
llama-server, `stop` is its stop words on chat, completions and the native /completion
(finish_reason "stop", `stop_type` "word"; proxy/sim/llamacpp_words.py), and a full
context ends the answer as llama-server ends it (`Plan.truncated`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from proxy.core.lax import lax_bool, lax_float, lax_int
from proxy.sim import errors
from proxy.sim.config import SimConfig
from proxy.sim.engine import Spec, spec_from
from proxy.sim.llamacpp_words import WordError, WordHit, first_word, read_words
from proxy.sim.stops import (
    StopError,
    StopHit,
    Stops,
    check_stop_sequences,
    first_stop,
    read_stops,
)
from proxy.sim.tokens import count_prompt_tokens

Kind = Literal[
    "chat",
    "completion",
    "messages",
    "responses",
    "generate",
    "cohere",
    "transcription",
    "translation",
    "ollama-chat",
    "ollama-generate",
    "llamacpp-completion",
]
UsageMode = Literal["separate", "last_chunk", "ignore", "zeroed"]

#: Faults that end the stream where they fire.
ENDING_FAULTS = frozenset({"error_event", "error_string", "reset", "close_no_done"})
#: Faults after which the stream carries on normally.
PASSING_FAULTS = frozenset({"stall", "malformed", "non_utf8", "huge_event"})
FAULTS = ENDING_FAULTS | PASSING_FAULTS
USAGE_MODES: tuple[UsageMode, ...] = ("separate", "last_chunk", "ignore", "zeroed")
BackendKind = Literal["vllm", "llamacpp"]
BACKEND_KINDS: tuple[BackendKind, ...] = ("vllm", "llamacpp")


@dataclass(frozen=True, slots=True)
class Plan:
    kind: Kind
    model: str
    stream: bool
    prompt_tokens: int
    cached_tokens: int | None
    output_tokens: int
    finish_reason: str
    ttft: float
    tokens_per_second: float
    tokens_per_chunk: int
    include_usage: bool
    continuous_usage: bool
    usage_mode: UsageMode
    no_done: bool
    fault: str | None
    fault_after: int
    stall: float
    huge_bytes: int
    #: CPU seconds to burn per generated token (0: none).
    cpu_per_token: float = 0.0
    #: The request's token limit as sent (max_tokens / max_output_tokens), if any.
    max_tokens: int | None = None
    #: The limit generation runs under: `max_tokens`, else what the context has left.
    token_limit: int = 0
    ping: bool = False
    #: Chat's role chunks, message_start and message-start with the headers, not with the
    #: first engine output (stream.py, events.py).
    early_role: bool = False
    incomplete_event: bool = False
    #: Send vLLM's per-request `metrics` object, and the programmed speculative decoding.
    metrics: bool = False
    spec: Spec | None = None
    #: Reasoning and tool calls (proxy/sim/agentic.py), and the answer's tokens then.
    script: Script | None = None
    answer_tokens: int = 0
    #: Whose wire shapes chat and completions take (proxy/sim/llamacpp.py for llamacpp).
    backend: BackendKind = "vllm"
    #: Choices (`n`, chat and completions): they decode together, a token each per step.
    n: int = 1
    #: Stop strings (chat and completions), and where one ends the generation, if it does.
    stops: Stops | None = None
    stop_hit: StopHit | None = None
    #: llama-server's stop words (proxy/sim/llamacpp_words.py), and where one ends it.
    words: tuple[str, ...] = ()
    word_hit: WordHit | None = None
    #: 1 where each choice ends with an EOS token: generated after the text, without text
    #: of its own, and counted in usage as vLLM counts it (its output token ids hold it:
    #: v1/engine/detokenizer.py:107-128, chat_completion/serving.py:684 and :1151), and
    #: as llama-server (`n_decoded`: proxy/sim/llamacpp.py) and Ollama (`eval_count`:
    #: proxy/sim/ollama.py) do; 0 where the token limit or a stop string ends it.
    eos: int = 0
    #: llama-server only: the answer's last token (the EOS included) filled the context,
    #: its native `truncated` (server-context.cpp process_token, without context shift).
    truncated: bool = False
    #: The KV cache's block size (SimConfig.prefix_cache_block, vLLM's --block-size): what
    #: a request writes to the prefix cache is counted in whole blocks of it.
    cache_block: int = 16

    @property
    def eos_shares_step(self) -> bool:
        """The EOS comes in the engine step of the last text tokens (several tokens a step,
        the last step not full), not in a step of its own."""
        return bool(self.eos) and self.output_tokens % self.tokens_per_chunk != 0


#: The size of one padding piece of a call's arguments (x-sim-tool-call-argument-bytes).
PAD_PIECE = 64 * 1024


@dataclass(frozen=True, slots=True)
class Script:
    """Reasoning and tool calls around the answer (proxy/sim/agentic.py)."""

    reasoning: int = 0
    reasoning_usage: bool = True  # False: usage says 0 reasoning tokens
    calls: int = 0
    invalid: int = 0  # the last `invalid` calls' arguments are no JSON object
    argument_bytes: int = 0  # padding per call's arguments
    merged: bool = False  # each phase's first token shares the event of the one before it

    def pieces(self, call: int) -> list[str]:
        """Call `call`'s arguments in pieces: `{"city": "Paris", "n": <call>}`, padded, and
        without its closing brace (so no JSON object) when it is one of the invalid ones."""
        pieces = ['{"city": ', '"Paris", ']
        pad = self.argument_bytes
        if pad:
            pieces.append('"pad": "')
            pieces += ["x" * PAD_PIECE] * max(1, -(-pad // PAD_PIECE))
            pieces.append('", ')
        invalid = call >= self.calls - self.invalid
        pieces.append(f'"n": {call}' if invalid else f'"n": {call}}}')
        return pieces

    def tokens(self, answer: int) -> int:
        """Every token of the script: reasoning, the answer, each call's opening and pieces."""
        return self.reasoning + answer + sum(1 + len(self.pieces(c)) for c in range(self.calls))


def script_from(headers: Mapping[str, str]) -> Script | None:
    names = ("x-sim-reasoning-tokens", "x-sim-tool-calls")
    if not any(name in headers for name in names):
        return None
    usage = headers.get("x-sim-reasoning-usage", "count")
    if usage not in ("count", "zero"):
        raise ControlError(f"x-sim-reasoning-usage: unknown value {usage!r}")
    merged = headers.get("x-sim-merged-boundaries", "0")
    if merged not in ("0", "1"):
        raise ControlError(f"x-sim-merged-boundaries: expected 0 or 1, got {merged!r}")
    calls = number(headers, "x-sim-tool-calls", int, 0, 0)
    return Script(
        reasoning=number(headers, "x-sim-reasoning-tokens", int, 0, 0),
        reasoning_usage=usage == "count",
        calls=calls,
        invalid=min(calls, number(headers, "x-sim-invalid-tool-calls", int, 0, 0)),
        argument_bytes=number(headers, "x-sim-tool-call-argument-bytes", int, 0, 0),
        merged=merged == "1",
    )


class ControlError(ValueError):
    """A malformed request or x-sim-* header; answered with a 400."""


class InvalidBody(ControlError):
    """A body vLLM's pydantic models refuse: the validation handler's `reply`, which no
    route's own error translation sees (Cohere's middleware does)."""

    def __init__(self, reply: errors.ErrorReply) -> None:
        super().__init__("invalid body")
        self.reply = reply


T = TypeVar("T", int, float)


def plan_request(
    kind: Kind, body: Any, headers: Mapping[str, str], config: SimConfig
) -> Plan | errors.ErrorReply:
    """The plan for a generation request, or the error reply vLLM would give instead."""
    try:
        plan = _plan(kind, body, headers, config)
    except ControlError as exc:
        # vLLM's request-validation handler answers in OpenAI's shape on every route.
        plan = exc.reply if isinstance(exc, InvalidBody) else errors.bad_request(str(exc))
        if REQUESTS[kind].cohere:
            return errors.cohere_error(plan, headers.get("x-request-id"))
        if not _plays_llamacpp(kind, headers, config):
            return plan
    if isinstance(plan, errors.ErrorReply) and _plays_llamacpp(kind, headers, config):
        return errors.llamacpp_error(plan)
    if REQUESTS[kind].anthropic and isinstance(plan, errors.ErrorReply):
        return errors.anthropic_error(plan)
    if REQUESTS[kind].cohere and isinstance(plan, errors.ErrorReply):
        return errors.cohere_error(plan, headers.get("x-request-id"))
    if REQUESTS[kind].ollama and isinstance(plan, errors.ErrorReply):
        model = body.get("model") if isinstance(body, dict) else None
        return errors.ollama_error(plan, str(model or config.models[0]))
    return plan


def _plays_llamacpp(kind: Kind, headers: Mapping[str, str], config: SimConfig) -> bool:
    return REQUESTS[kind].llamacpp and (
        headers.get("x-sim-backend-kind", config.backend_kind) == "llamacpp"
    )


def stall_before_headers(headers: Mapping[str, str]) -> float:
    try:
        return number(headers, "x-sim-stall-before-headers", float, 0.0, 0.0)
    except ControlError:
        return 0.0


#: vLLM 0.32's answer to a completion without a prompt (completion/protocol.py:591-610,
#: a VLLMValidationError: its text ends with its parameter, exceptions.py:49-60).
NO_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)"


def _check_prompt_or_embeds(body: dict[str, Any]) -> None:
    """vLLM's CompletionRequest `validate_prompt_and_prompt_embeds`: a prompt that is
    missing, null or "", with prompt_embeds missing, null or [], is its 400."""
    prompt, embeds = body.get("prompt"), body.get("prompt_embeds")
    if prompt in (None, "") and (embeds is None or embeds == []):
        raise InvalidBody(errors.bad_request(NO_PROMPT, "prompt"))


def _plan(
    kind: Kind, body: Any, headers: Mapping[str, str], config: SimConfig
) -> Plan | errors.ErrorReply:
    if not isinstance(body, dict):
        raise ControlError("The request body must be a JSON object.")
    rules = REQUESTS[kind]
    if rules.prompt_or_embeds and not _plays_llamacpp(kind, headers, config):
        _check_prompt_or_embeds(body)
    for field in rules.lists:
        if not isinstance(body.get(field), list):
            raise ControlError(f"Field required: {field}")
    for field in rules.required:
        if body.get(field) is None:
            raise ControlError(f"Field required: {field}")
    if rules.stop_sequences:
        refused = check_stop_sequences(body.get("stop_sequences"), config.max_stop_strings)
        if refused is not None:
            raise InvalidBody(refused)
    if rules.read is not None:
        body = rules.read(body)
    raw_backend = headers.get("x-sim-backend-kind", config.backend_kind)
    if raw_backend not in BACKEND_KINDS:
        raise ControlError(f"x-sim-backend-kind: unknown value {raw_backend!r}")
    backend: BackendKind = "llamacpp" if raw_backend == "llamacpp" else "vllm"
    llama = backend == "llamacpp" and rules.llamacpp
    words: tuple[str, ...] = ()
    if llama:
        _llamacpp_n(body.get("n"))
        try:
            words = read_words(body.get("stop"))
        except WordError as exc:
            raise ControlError(str(exc)) from None
    stop = body.get("stop")
    # pydantic's check (generate/base/protocol.py StopParam), before any other
    if (
        rules.sampling
        and not llama
        and isinstance(stop, list)
        and len(stop) > config.max_stop_strings
    ):
        return errors.too_long("stop", len(stop), config.max_stop_strings)
    model = str(body.get("model") or config.models[0])
    if llama and model not in config.models:
        model = config.models[0]  # a single-model llama-server ignores `model`
    prompt_tokens = count_prompt_tokens(body)
    n_ctx = config.max_model_len
    max_tokens, limit_field = None, rules.limit[-1]
    for field in rules.limit:  # the first that is set and not 0 (`a or b`)
        max_tokens = body.get(field)
        if max_tokens:
            limit_field = field
            break
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ControlError(f"max_tokens must be at least 1, got {max_tokens}.")

    forced = headers.get("x-sim-error")
    if forced is not None:
        if forced not in errors.FORCED_ERRORS:
            raise ControlError(f"x-sim-error: unknown value {forced!r}")
        if llama and forced == "context_length":
            return errors.llamacpp_context(max(prompt_tokens, n_ctx), n_ctx)
        return errors.forced_error(
            forced,
            model=model,
            max_model_len=config.max_model_len,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
        )
    if model not in config.models:
        return errors.model_not_found(model)
    room = n_ctx - prompt_tokens
    if llama:
        # llama-server checks the prompt alone; generation then stops where the context
        # is full, with finish_reason "length" (as the real server does).
        if room <= 0:
            return errors.llamacpp_context(prompt_tokens, n_ctx)
    elif rules.ollama:
        limits = _ollama_limits(body, prompt_tokens, max_tokens, n_ctx)
        if limits is None:
            return errors.bad_request(errors.OLLAMA_CONTEXT)
        prompt_tokens, room = limits
    elif max_tokens is not None and max_tokens > n_ctx:
        return errors.max_tokens_over(limit_field, max_tokens, n_ctx)
    elif room <= 0:
        return errors.prompt_over(n_ctx, prompt_tokens)

    sampling = rules.sampling and not llama
    choices = (
        _choices(body, config.max_n_sequences) if sampling else _prompts(body) if rules.batch else 1
    )
    if isinstance(choices, errors.ErrorReply):
        return choices
    include_stop = lax_bool(body.get("include_stop_str_in_output")) is True
    try:
        stops = read_stops(body.get("stop"), include_stop) if sampling else None
        if rules.stop_sequences:
            # vLLM 0.32 runs these as chat with `stop=stop_sequences` and the chat
            # request's default include_stop_str_in_output (False): anthropic/serving.py
            # _build_base_request, cohere/serving.py _build_base_chat_completion.
            stops = read_stops(body.get("stop_sequences"), False)
    except StopError as exc:
        return errors.bad_request(str(exc))
    planned = number(headers, "x-sim-output-tokens", int, config.output_tokens, 0)
    min_tokens = _min_tokens(body, max_tokens, room) if sampling else 0
    if isinstance(min_tokens, errors.ErrorReply):
        return min_tokens
    # A script is streamed only (docs/reasoning.md): a body would have ended "tool_calls"
    # with no call in it, or counted reasoning it never carried.
    script = script_from(headers) if lax_bool(body.get("stream")) is True else None
    if script is not None:
        choices, stops, words = 1, None, ()  # a script streams one choice, to its own end
    answer = planned
    if script is not None:
        planned = script.tokens(answer)
    limit = room if max_tokens is None else min(max_tokens, room)
    if script is None:  # min_tokens holds back the EOS too (v1/core/sched/utils.py check_stop)
        planned = max(planned, min_tokens)
    finish = "stop" if script is None or not script.calls else "tool_calls"
    # The EOS is a token of its own after the text, so it needs room under the limit:
    # a text that fills the limit ends with "length" (v1/core/sched/utils.py check_stop
    # checks the EOS first, then the limit). llama-server alike: process_token's EOG
    # check comes after its budget check and overrides it (server-context.cpp), so an
    # EOS as the limit's last token is "eos", a text token there "limit"; and Ollama,
    # which runs llama-server (llm/llama_server.go: stop_type "limit" is "length").
    # A script (reasoning, tool calls) ends where it ends: ignore_eos does not stretch it.
    if (body.get("ignore_eos") and script is None) or planned + 1 > limit:
        planned, finish = limit, "length"
    spec = spec_from(
        number(headers, "x-sim-spec-tokens", int, config.spec_tokens, 0),
        number(headers, "x-sim-acceptance-rate", float, config.acceptance_rate, 0.0),
    )
    per_chunk = number(headers, "x-sim-tokens-per-chunk", int, 1, 1)
    if spec is not None:
        per_chunk = spec.per_chunk
    hit = None if stops is None else first_stop(stops, planned, per_chunk, min_tokens)
    if hit is not None:
        planned, finish = hit.tokens, "stop"
    word = first_word(words, planned) if words else None
    if word is not None:  # llama-server's finish_reason for STOP_TYPE_WORD
        planned, finish = word.tokens, "stop"
        # ... unless that token fills the context: process_token's context check comes
        # after the stop-word check and sets STOP_TYPE_LIMIT over it ("length" on the
        # OpenAI routes; `stopping_word` stays). The real binary, --ctx-size 256, a
        # grammar of 252 " upon" and " once", `stop: ["once"]`: stop_type "limit".
        if llama and planned >= room:
            finish = "length"
    # What ended the generation decides the EOS, whatever finish_reason a header forces,
    # but a forced "length" is a choice cut by its limit, which has none.
    finish_reason = headers.get("x-sim-finish-reason", finish)
    ended_by_text = hit is not None or word is not None
    eos = 1 if finish != "length" and not ended_by_text and finish_reason != "length" else 0
    # llama-server, without context shift (its default: common.h ctx_shift = false), stops
    # a slot at the token that fills its context, counted, and marks it `truncated`
    # (server-context.cpp process_token: `slot.prompt.n_tokens() + 1 >= slot.n_ctx`),
    # whatever else ends it there: an EOS at that token is still STOP_TYPE_EOS, since the
    # EOG check comes after (the real binary: stop_type "eos", truncated true).
    truncated = llama and planned + eos >= room

    options = body.get("stream_options") or {}
    # read as vLLM's pydantic models read it: `1` and "true" ask, "false" does not
    include_usage = isinstance(options, dict) and lax_bool(options.get("include_usage")) is True
    usage_mode = headers.get("x-sim-usage-mode", "separate")
    if usage_mode not in USAGE_MODES:
        raise ControlError(f"x-sim-usage-mode: unknown value {usage_mode!r}")
    fault = headers.get("x-sim-fault")
    if fault is not None and fault not in FAULTS:
        raise ControlError(f"x-sim-fault: unknown value {fault!r}")
    cached: int | None = number(headers, "x-sim-cached-tokens", int, config.cached_tokens, 0)
    if cached == 0 and "x-sim-cached-tokens" not in headers:
        cached = None  # vLLM sends no prompt_tokens_details unless something is cached
    ttft = number(headers, "x-sim-ttft", float, config.ttft, 0.0)
    ttft += prompt_tokens * number(
        headers, "x-sim-ttft-per-prompt-token", float, config.ttft_per_prompt_token, 0.0
    )

    return Plan(
        kind=kind,
        model=model,
        stream=lax_bool(body.get("stream")) is True,
        prompt_tokens=prompt_tokens,
        cached_tokens=None if cached is None else min(prompt_tokens, cached),
        cache_block=config.prefix_cache_block,
        output_tokens=planned,
        finish_reason=finish_reason,
        ttft=ttft,
        tokens_per_second=number(headers, "x-sim-tps", float, config.tokens_per_second, 1e-9),
        tokens_per_chunk=per_chunk,
        include_usage=include_usage and usage_mode != "ignore",
        continuous_usage=include_usage
        and usage_mode != "ignore"
        and bool(options.get("continuous_usage_stats")),
        usage_mode=usage_mode,
        no_done=_flag(headers, "x-sim-no-done"),
        fault=fault,
        fault_after=number(headers, "x-sim-fault-after", int, 0, 0),
        stall=number(headers, "x-sim-stall", float, 1.0, 0.0),
        huge_bytes=number(headers, "x-sim-huge-bytes", int, 4 * 1024 * 1024, 1024),
        cpu_per_token=number(headers, "x-sim-cpu-per-token-us", float, config.cpu_per_token_us, 0.0)
        / 1e6,
        max_tokens=max_tokens,
        token_limit=limit,
        ping=_flag(headers, "x-sim-ping"),
        early_role=_flag(headers, "x-sim-early-role", config.early_role),
        incomplete_event=_flag(headers, "x-sim-incomplete-event"),
        metrics=config.per_request_metrics or _flag(headers, "x-sim-metrics"),
        spec=spec,
        script=script,
        answer_tokens=answer,
        backend=backend,
        n=choices,
        stops=stops,
        stop_hit=hit,
        words=words,
        word_hit=word,
        eos=eos,
        truncated=truncated,
    )


#: vll/sampling_params.py _SAMPLING_EPS: a temperature below it samples greedily.
SAMPLING_EPS = 1e-5


def _choices(body: dict[str, Any], max_n: int) -> int | errors.ErrorReply:
    """`n` as vLLM reads and checks it (vllm/sampling_params.py: _verify_num_sequences, its
    cap VLLM_MAX_N_SEQUENCES, and _verify_greedy_sampling at temperature 0). llama-server's
    own check is _llamacpp_n."""
    raw = body.get("n")
    if raw is None:
        return 1
    n = lax_int(raw)
    if n is None:
        raise ControlError(f"n: Input should be a valid integer, got {raw!r}")
    if n < 1:
        return errors.bad_request(f"n must be at least 1, got {n}.")
    if n > max_n:
        return errors.bad_request(
            f"n must be at most {max_n}, got {n}. To increase this limit, set the "
            "VLLM_MAX_N_SEQUENCES environment variable."
        )
    temperature = lax_float(body.get("temperature"))
    if n > 1 and temperature is not None and temperature < SAMPLING_EPS:
        return errors.bad_request(f"n must be 1 when using greedy sampling, got {n}.")
    return n


def _min_tokens(body: dict[str, Any], max_tokens: int | None, room: int) -> int | errors.ErrorReply:
    """`min_tokens` as vLLM reads and checks it (vllm/sampling_params.py _verify_args),
    against the limit it runs under (`max_tokens`, else the room left: get_max_tokens)."""
    raw = body.get("min_tokens")
    if raw is None:
        return 0
    value = lax_int(raw)
    if value is None:
        raise ControlError(f"min_tokens: Input should be a valid integer, got {raw!r}")
    if value < 0:
        return errors.bad_request(f"min_tokens must be greater than or equal to 0, got {value}.")
    limit = room if max_tokens is None else min(max_tokens, room)
    if value > limit:
        return errors.bad_request(
            f"min_tokens must be less than or equal to max_tokens={limit}, got {value}."
        )
    return value


def _generate_body(body: dict[str, Any]) -> dict[str, Any]:
    """A token-in/token-out request read as a completion: `token_ids` are the prompt and
    `sampling_params` hold max_tokens and ignore_eos (vllm/entrypoints/scale_out/
    token_in_token_out/protocol.py, GenerateRequest)."""
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
        raise ControlError("Field required: token_ids (a list of token ids)")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise ControlError("sampling_params must be an object")
    return {
        "model": body.get("model"),
        "stream": body.get("stream"),
        "stream_options": body.get("stream_options"),
        "prompt": ids,
        "max_tokens": params.get("max_tokens"),
        "ignore_eos": params.get("ignore_eos"),
    }


def _llamacpp_native_body(body: dict[str, Any]) -> dict[str, Any]:
    """llama-server's native /completion read as a completion (server-task.cpp
    params_from_json_cmpl): the limit `n_predict`, else `max_tokens`; -1 (or unset)
    generates until EOS or a full context."""
    limit = body.get("n_predict", body.get("max_tokens"))
    return {
        "model": body.get("model"),
        "stream": body.get("stream"),
        "prompt": body.get("prompt"),
        "max_tokens": limit if type(limit) is int and limit > 0 else None,
        "ignore_eos": body.get("ignore_eos"),
        "stop": body.get("stop"),
    }


def _prompts(body: dict[str, Any]) -> int:
    """A list of prompts (texts or token-id lists) decodes that many together; a list of
    token ids is one prompt."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and any(type(p) is not int for p in prompt):
        return len(prompt)
    return 1


def _llamacpp_n(n: object) -> None:
    """llama-server makes one choice: `n` other than 1 is its 400, in the words of the
    real server (.ci/llama's build, captured; tests/sim/test_sim_llamacpp.py)."""
    if n is None:
        return
    if isinstance(n, (int, float)):  # read as an int, as nlohmann's: 1.5 and true are 1
        if int(n) != 1:
            raise ControlError(
                f"Field 'n': Value must be between 1 <= value <= 1, but got {int(n)}"
            )
        return
    kind = "string" if isinstance(n, str) else "array" if isinstance(n, list) else "object"
    raise ControlError(
        f"Field 'n': [json.exception.type_error.302] type must be number, but is {kind}"
    )


#: ollama/ollama llm/llama_server.go: an open-ended num_predict runs to this many contexts.
OLLAMA_PREDICT_CONTEXTS = 10
#: ollama/ollama api/types.go DefaultOptions: NumKeep.
OLLAMA_NUM_KEEP = 4


def _ollama_limits(
    body: dict[str, Any], prompt_tokens: int, num_predict: int | None, n_ctx: int
) -> tuple[int, int] | None:
    """Ollama's prompt and generation limits (ollama/ollama llm/llama_server.go, runner on
    llama-server): `(prompt tokens, token limit)`, or None for its 400.

    boundedNumPredict caps num_predict (unset or -1: open-ended) at OLLAMA_PREDICT_CONTEXTS
    contexts; nothing checks it against the context. completionPromptForRequest refuses a
    prompt of n_ctx tokens or more only with context shift off (`"shift": false`;
    server/sched.go resolveContextShift has it on otherwise); with it on the prompt is cut
    to contextShiftPromptLimit, keeping num_keep tokens (the BOS that llama_server.go adds
    to them is not modelled). llama-server runs with --context-shift then, so generation
    goes past the context; without it generation stops where the context is full.
    """
    limit = OLLAMA_PREDICT_CONTEXTS * n_ctx
    if num_predict is not None:
        limit = min(limit, num_predict)
    shift = body.get("shift") is not False
    if prompt_tokens > n_ctx - 1:
        if not shift:
            return None
        keep = body.get("num_keep")
        keep = keep if isinstance(keep, int) else OLLAMA_NUM_KEEP
        keep = min(prompt_tokens if keep < 0 else keep, n_ctx - 1)  # -1: the whole prompt
        prompt_tokens = n_ctx - max((n_ctx - keep) // 2, 1)
    return prompt_tokens, limit if shift else min(limit, n_ctx - prompt_tokens)


def _ollama_body(body: dict[str, Any]) -> dict[str, Any]:
    """An Ollama request read as a completion (ollama/ollama api/types.go ChatRequest,
    GenerateRequest): streaming unless `"stream": false`, the token limit in
    `options.num_predict`."""
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise ControlError("options must be an object")
    limit = options.get("num_predict")
    out = {
        "model": body.get("model"),
        "stream": body.get("stream") is not False,
        "max_tokens": limit if isinstance(limit, int) and limit > 0 else None,
        "shift": body.get("shift"),
        "num_keep": options.get("num_keep", OLLAMA_NUM_KEEP),
    }
    if "messages" in body:
        out["messages"] = body["messages"]
    else:
        out["prompt"] = body.get("prompt") or ""
    return out


def number(
    headers: Mapping[str, str], name: str, conv: Callable[[str], T], default: T, minimum: T
) -> T:
    raw = headers.get(name)
    if raw is None:
        return default
    try:
        value = conv(raw)
    except ValueError:
        raise ControlError(f"{name}: not a number: {raw!r}") from None
    if value < minimum:
        raise ControlError(f"{name}: must be >= {minimum}, got {raw!r}")
    return value


def _flag(headers: Mapping[str, str], name: str, default: bool = False) -> bool:
    raw = headers.get(name)
    return default if raw is None else raw.lower() in ("1", "true", "yes")


def burn_cpu(seconds: float) -> None:
    """Spend `seconds` of this thread's CPU in a busy loop (a CPU-bound backend's work).

    Counted on the thread's CPU clock, not the wall clock: on a shared box the loop
    takes longer but still costs exactly that much CPU.
    """
    if seconds <= 0:
        return
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@dataclass(frozen=True, slots=True)
class Request:
    """What one generation API's request must carry, checked as vLLM checks it."""

    lists: tuple[str, ...] = ()  # fields that must be lists ("Field required" otherwise)
    required: tuple[str, ...] = ()  # fields that must be present
    limit: tuple[str, ...] = ("max_completion_tokens", "max_tokens")  # the token limit
    read: Callable[[dict[str, Any]], dict[str, Any]] | None = None  # the body as a completion
    anthropic: bool = False  # its errors in Anthropic's shape
    cohere: bool = False  # its errors in Cohere's {message, id}
    stop_sequences: bool = False  # reads `stop_sequences` (Anthropic's, Cohere's) as `stop`
    ollama: bool = False  # its errors in Ollama's {"error": "..."}, its limits
    llamacpp: bool = False  # llama-server's errors and limits when the simulator plays it
    sampling: bool = False  # reads vLLM's `n` and `stop` (not when playing llama-server)
    batch: bool = False  # a list of prompts is that many choices (llama-server's /completion)
    prompt_or_embeds: bool = False  # vLLM's completion: a prompt or prompt_embeds, non-empty


#: Each kind's request rules: a new generation API adds its line here.
REQUESTS: dict[Kind, Request] = {
    "chat": Request(lists=("messages",), llamacpp=True, sampling=True),
    "completion": Request(
        required=("prompt",), llamacpp=True, sampling=True, prompt_or_embeds=True
    ),
    "messages": Request(
        lists=("messages",), required=("max_tokens",), anthropic=True, stop_sequences=True
    ),
    "responses": Request(required=("input",), limit=("max_output_tokens",)),
    "generate": Request(read=_generate_body),
    "cohere": Request(lists=("messages",), cohere=True, stop_sequences=True),
    "transcription": Request(),
    "translation": Request(),
    "ollama-chat": Request(
        lists=("messages",), read=_ollama_body, limit=("max_tokens",), ollama=True
    ),
    "ollama-generate": Request(read=_ollama_body, limit=("max_tokens",), ollama=True),
    "llamacpp-completion": Request(
        required=("prompt",),
        limit=("max_tokens",),
        read=_llamacpp_native_body,
        llamacpp=True,
        batch=True,
    ),
}
