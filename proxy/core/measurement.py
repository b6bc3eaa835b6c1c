"""The per-request record every sink reads (and none changes), and the closed error types.

Instants (all `time.perf_counter()` seconds, taken by the proxy):
  start        the proxy received the request line and headers (ASGI call began)
  first_byte   the upstream's response headers arrived
  first_token  the first network read that carried an event with generated content, as
               the request's API defines it (proxy/core/apis/; the README's "APIs
               measured" lists each): e.g. a non-empty chat delta `content`, `reasoning` or
               `tool_calls`, never vLLM's role-only first chunk, Anthropic's
               `message_start` or the Responses API's `response.created`. With n > 1
               choices: the first content of any choice.
  last_token   the last network read that carried generated content (any choice); for
               tpot and decode speed, a choice's finish read after its last content when
               the output count is the backend's, which counts the EOS that ended it
               (StreamObserver._ending_reads; docs/measured.md)
  end          the response finished (last byte relayed, error, or client gone)
  read         the request's whole body was read (the data path reports it)
  sent         the request was handed to the upstream connection (the data path reports it)
  relayed      the response head went out to the client (the data path reports it)

Derived durations:
  ttfb   first_byte - start
  ttft   first_token - start
  itl    each gap between consecutive content events of the same choice (0 when two
         arrive in one read)
  tpot   (last_token - first_token) / (output_tokens - 1), needs >= 2 output tokens
         and a span above 0 (tokens all in one read measured no time: None, not 0);
         None where the count is only of what streamed (chunks, a tokenizer) and tools
         were offered or a call came: a tool parser's held tokens are in the span but not
         in the count (StreamObserver._held_uncounted); None where the first content read
         carried a tool call whole (`whole_call_first`): the call's tokens were decoded
         before it, outside the span
  decode_tokens_per_second   (output_tokens - 1) / (last_token - first_token), with tpot
  e2e    end - start
  proxy_overhead   (sent - read) + (relayed - first_byte): the proxy's own time
  engine   the engine's per-request figures (proxy/core/engine.py), when it sent them;
           the TTFT split (queue, engine TTFT, outside the engine) is `ttft_split`, none
           where the TTFT holds a whole tool call's decoding (`whole_call_first`)

First tokens by kind (seconds after `start`, as ttft; issue 26): `first_answer` the first
read carrying answer content (chat `content`, Messages `text_delta`, Responses
`output_text`, Cohere text), `first_reasoning` / `last_reasoning` the first and last reads
carrying reasoning, `first_tool_call` the first read carrying a tool call's first delta.
  ttfa                 first_answer (what a chat user waits for)
  reasoning_duration   last_reasoning - first_reasoning
  reasoning_tpot       reasoning_duration / (reasoning_tokens - 1)
  answer_tpot          (last answer read - first_answer) / (answer tokens - 1), answer
                       tokens = output_tokens - reasoning_tokens, for streams without calls
                       whose request offered no tools (a tool parser may hold tokens back)

With n > 1 choices, tpot and decode speed are computed per choice, from that choice's own
first and last token and its share of the output tokens (in proportion to its content
events), and the request's figures are those of the median choice by tpot (the lower
median for an even n, so always one real choice). With one choice this is the formula above.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from proxy.core.engine import EngineMetrics, load_split, ttft_split
from proxy.core.fingerprint import Prefix
from proxy.core.toolcalls import ToolCall


class ErrorType(enum.StrEnum):
    """Why a request did not succeed. Exactly one per failed request; a closed set."""

    AUTH = "auth"  # 401/403, or a body saying the key/token is invalid or its exchange failed
    CONTEXT_LENGTH = "context_length"  # prompt + max_tokens exceed the model's context
    RATE_LIMIT = "rate_limit"  # 429
    BAD_REQUEST = "bad_request"  # any other 4xx (and requests the proxy itself refuses)
    NOT_FOUND = "not_found"  # 404: unknown model or route
    UPSTREAM_ERROR = "upstream_error"  # 5xx (the proxy's own 503 at shutdown too; status 0
    # for a pipelined request the drain's end dropped before its turn)
    UPSTREAM_UNREACHABLE = "upstream_unreachable"  # connect failed (not for want of the
    # proxy's own files or ports: that is UPSTREAM_ERROR, proxy/core/errors.py)
    UPSTREAM_TIMEOUT = "upstream_timeout"  # connect, first byte or idle gap timed out
    STREAM_ERROR = "stream_error"  # a server's failure reported inside a 200 stream (a
    # client's error reported there is its own kind: errors.classify_stream_end)
    STREAM_TRUNCATED = "stream_truncated"  # stream ended without its API's end ([DONE] or a
    # finish_reason, message_stop, response.completed/incomplete)
    CLIENT_CANCELLED = "client_cancelled"  # the client went away first


class TokenSource(enum.StrEnum):
    """Where the token counts of a record came from, most trusted first."""

    USAGE = "usage"  # the backend's `usage` object
    ENGINE = "engine"  # the engine's own account without usage (llama.cpp timings)
    TOKENIZER = "tokenizer"  # counted by the configured tokenizer
    TOKEN_IDS = "token_ids"  # output = the token ids streamed (exact), prompt = the ids sent
    CHUNKS = "chunks"  # output = number of content events; prompt unknown
    # (With TOKENIZER or CHUNKS, a prompt count usage gave before the stream was cut short,
    # as Messages' message_start does, is kept beside the output counted so.)
    NONE = "none"  # nothing to count (error before any output)


#: The sources that counted the output's tokens (the chunks' count does not).
_COUNTED = frozenset(
    (TokenSource.USAGE, TokenSource.ENGINE, TokenSource.TOKEN_IDS, TokenSource.TOKENIZER)
)


#: Label value for "no error" and "no finish_reason".
NONE_LABEL = "none"


@dataclass(slots=True)
class Measurement:
    """Everything measured about one proxied request. Durations in seconds, None if unknown.

    Made once per request by the observer; the dispatcher fills in its conversation fields
    (proxy/sinks/conversations.py) before any sink sees it, and sinks only read it. It is
    not frozen because that costs each request twice: a frozen dataclass's `__init__` sets
    every field through `object.__setattr__` (46 fields: 9.2 µs against 2.2), and filling
    in five fields by `dataclasses.replace` built a whole second record (10.8 µs).
    """

    endpoint: str  # the Api's label: its canonical path (proxy/core/apis ENDPOINTS)
    model: str  # the requested model as sent by the client ("" if none)
    stream: bool  # the response was an event stream (what was measured as one)
    # The client asked for a stream (its request's `stream`); None when the proxy never
    # read that: refused or left before its body was in, or a body it could not decode.
    stream_requested: bool | None
    status_code: int  # what the client received (0 if nothing was sent)
    started_at: float  # wall clock (time.time()) at `start`, for logs and traces
    ttfb: float | None
    ttft: float | None
    tpot: float | None
    decode_tokens_per_second: float | None
    e2e: float
    inter_token_latencies: tuple[float, ...]
    prompt_tokens: int | None
    output_tokens: int | None
    cached_prompt_tokens: int | None
    token_source: TokenSource
    content_events: int
    finish_reason: str  # the closed-set label (apis.FINISH_LABELS); NONE_LABEL when none
    error_type: ErrorType | None
    error_message: str | None = None  # short, secret-free description
    response_id: str | None = None
    response_model: str | None = None
    # The backend's `system_fingerprint` as it sent it (OpenAI's chat and completions: vLLM
    # 0.32 writes it on the terminal chunk, or the usage chunk, and on a whole answer); None
    # when it sent none.
    system_fingerprint: str | None = None
    # Prompt tokens the backend wrote to its prefix cache, among `prompt_tokens`, as usage
    # says (vLLM 0.32 with --enable-prompt-tokens-details: chat's
    # prompt_tokens_details.created_cache_tokens, OpenAI's cache_write_tokens there,
    # Responses' input_tokens_details.cache_write_tokens, Messages'
    # cache_creation_input_tokens); None when usage does not say (completions never does).
    cache_write_tokens: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    trace_id: str | None = None  # 32 hex digits when the request was traced and sampled
    raw_finish_reason: str | None = None  # as the backend wrote it (end_turn, completed, ...)
    # With several choices (n > 1), each one's finish label in index order, NONE_LABEL for
    # one that streamed content and never finished; () with one choice (finish_reason).
    finish_reasons: tuple[str, ...] = ()
    engine: EngineMetrics | None = None  # the engine's own per-request figures, if sent
    # The first content read carried a tool call whole (StreamObserver.whole_call_first:
    # Ollama sends each call once its parser has it). The TTFT holds the call's decoding:
    # no TPOT or decode speed, and no TTFT split (the engine's own figures stay in `engine`).
    whole_call_first: bool = False
    proxy_overhead: float | None = None  # seconds of the proxy's own time (see above)
    # The prompt's prefix fingerprint (core/fingerprint.py), unkeyed: only the access log
    # shows it, keyed with the deployment's salt.
    prefix: Prefix | None = None
    audio_seconds: float | None = None  # /v1/realtime: the audio appended for this utterance
    # Issue 26: first tokens by kind, seconds after `start` (see above), tokens by kind,
    # tool calls. reasoning_token_source: a TokenSource value (usage, tokenizer), "output" or "events".
    first_answer: float | None = None
    first_reasoning: float | None = None
    last_reasoning: float | None = None
    first_tool_call: float | None = None
    reasoning_tokens: int | None = None
    reasoning_token_source: str | None = None
    reasoning_events: int = 0
    reasoning_tpot: float | None = None
    answer_tpot: float | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    # A generative stream that generated output but delivered no answer token and no tool
    # call: how it ended (length, stop, error, cancelled); None for every other request.
    without_answer: str | None = None
    # The conversation (proxy/core/conversations.py): its id (a keyed hash), this request's
    # turn (1: its first; None for a request refused with an error status, which is no
    # turn: proxy/sinks/conversations.py `refused`), how a continuation was recognised
    # (header, previous_response, messages; None for a first turn), the previous answer's
    # end -> this request's start, and the tokens of the earlier prompt this one repeats
    # (the shared prefix).
    conversation_id: str | None = None
    conversation_named: bool = False  # the id stands for the client's (its header)
    turn: int | None = None
    continued_via: str | None = None
    turn_gap: float | None = None
    shared_prefix_tokens: int | None = None
    # Streamed events (SSE payloads, NDJSON lines) that were not a JSON object: skipped,
    # relayed as they came, counted here.
    malformed_events: int = 0

    @property
    def ok(self) -> bool:
        return self.error_type is None

    @property
    def cancelled(self) -> bool:
        """The client walked away before the end: what was computed, nobody received."""
        return self.error_type is ErrorType.CLIENT_CANCELLED

    @property
    def ttfa(self) -> float | None:
        """Time to first answer token: `first_answer`, seconds after start."""
        return self.first_answer

    @property
    def reasoning_duration(self) -> float | None:
        first, last = self.first_reasoning, self.last_reasoning
        return None if first is None or last is None else last - first

    @property
    def answer_tokens(self) -> int | None:
        """Output tokens that were not reasoning, when both counts are known."""
        output, reasoning = self.output_tokens, self.reasoning_tokens
        if output is None or reasoning is None or reasoning > output:
            return None
        return output - reasoning

    def tool_call_outcomes(self) -> dict[str, int]:
        """How many of this request's tool calls ended each way (proxy/core/toolcalls.py)."""
        counts: dict[str, int] = {}
        for call in self.tool_calls:
            counts[call.outcome] = counts.get(call.outcome, 0) + 1
        return counts

    def ttft_split(self) -> tuple[float | None, float, float] | None:
        """(queue, engine TTFT, outside the engine), summing to `ttft`, for a stream whose
        engine sent its TTFT (the queue part None when it sends no queue time); None
        otherwise, and where the TTFT holds a whole tool call's decoding
        (`whole_call_first`): what is left outside the engine would be that decoding."""
        engine, ttft = self.engine, self.ttft
        if engine is None or ttft is None or not self.stream or self.whole_call_first:
            return None
        return ttft_split(ttft, engine)

    def load_split(self) -> tuple[float, float, float] | None:
        """(model load, engine TTFT, outside the engine), summing to `ttft`, for a stream
        whose engine sent a load time and its TTFT but no queue time (Ollama); None
        otherwise, and where the TTFT holds a whole tool call's decoding, as `ttft_split`."""
        engine, ttft = self.engine, self.ttft
        if engine is None or ttft is None or not self.stream or self.whole_call_first:
            return None
        return load_split(ttft, engine)

    def ttft_parts(self) -> tuple[float | None, float | None, float | None]:
        """(queue, engine TTFT, outside the engine) as every sink reports them: the split
        when there is one, else the engine's own figures and no outside part. With a
        model load part (load_split) the queue is None and outside excludes the load."""
        split = self.ttft_split()
        if split is not None:
            return split
        loaded = self.load_split()
        if loaded is not None:
            return None, loaded[1], loaded[2]
        engine = self.engine
        if engine is None:
            return None, None, None
        return engine.queue_time, engine.time_to_first_token, None

    def continuation_cache_ratio(self) -> float | None:
        """A continuation's cached prompt tokens over its shared prefix's tokens (at most
        1), when the backend reported cached tokens and the shared prefix is known."""
        shared, cached = self.shared_prefix_tokens, self.cached_prompt_tokens
        if self.continued_via is None or not shared or cached is None:
            return None
        return min(1.0, cached / shared)

    def output_tokens_per_chunk(self) -> float | None:
        """Output tokens per content event of a stream, when the tokens were counted (usage,
        the engine's figures, the token ids streamed, or a tokenizer; counting chunks
        would make it 1 by definition)."""
        if (
            not self.stream
            or not self.content_events
            or self.output_tokens is None
            or self.token_source not in _COUNTED
        ):
            return None
        return self.output_tokens / self.content_events
