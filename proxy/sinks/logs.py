"""The access-log sink: one line per measured request, as JSON or as logfmt text.

Keys, in this order, stable (a key without a value is null in JSON, left out in text):

  ts             when the proxy received the request, ISO-8601 UTC with ms ("...T12:00:00.123Z")
  arrival        the same instant as Unix seconds with microseconds (what a replay schedules by)
  model          the model the client asked for (first 200 characters, credentials masked)
  endpoint       the API's label, its canonical path (/v1/chat/completions, /v1/messages, ...)
  status         HTTP status the client got (0: nothing was sent)
  error_type     the proxy's error type (see ErrorType), null on success
  finish_reason  the closed-set label (stop, length, tool_calls, ...), null when there was none
  raw_finish_reason  the backend's own value (end_turn, max_output_tokens, ...), null if none
  prompt_tokens, output_tokens, cached_tokens, token_source   counts and where they came from
  cache_write_tokens   prompt tokens the backend wrote to its prefix cache (usage: chat's
                 prompt_tokens_details.created_cache_tokens, Responses'
                 input_tokens_details.cache_write_tokens, Messages'
                 cache_creation_input_tokens), null when usage does not say
  ttfb_ms, ttft_ms, tpot_ms, e2e_ms   latencies in milliseconds
  decode_tps     single-stream decode speed, tokens per second
  load_ms        the model load before the request could run (Ollama's load_duration),
                 null from an engine that reports none (vLLM, llama.cpp)
  queue_ms, engine_ttft_ms, outside_engine_ms   where the first token's time went: the
                 engine's queue time and TTFT (vLLM per-request metrics) and the rest of
                 the client-seen TTFT (a stream's three sum to ttft_ms, or with a model load
                 load_ms + engine_ttft_ms + outside_engine_ms does; null without them)
  tokens_per_chunk   output tokens per content event (usage, engine, token ids or tokenizer counts)
  spec_draft_tokens, spec_accepted_tokens   speculative decoding, as the engine counted
  proxy_overhead_ms   the proxy's own time (body read -> upstream, head in -> head out)
  stream         whether the client asked for a stream (its request's `stream`, whatever came back)
  max_tokens     the output limit the client asked for (max_tokens, max_output_tokens, ...)
  prefix         the prefix fingerprint: keyed hashes (16 hex digits) of the prompt's leading
                 units, cumulative: messages 1, 1-2, 1-3, ... (at most 8) for chat, Messages
                 (its system first) and Responses; leading 256-character blocks for a text
                 prompt (completions). Keyed with --log-salt, which is never logged.
  prefix_chars   characters of the prompt each prefix hash covers (cumulative)
  prompt_chars   characters of the whole prompt, as hashed (JSON of each message, or the text)
  trace_id       the request's trace id when traced and sampled
  response_id    the backend's response id
  system_fingerprint   the backend's `system_fingerprint` (OpenAI chat and completions; vLLM:
                 `vllm-<version>-<hash>` by default, null with --fingerprint-mode none)
  error          a short description of the error: the upstream's own words (its error
                 body's message, or an error event's), whitespace folded, credentials
                 masked (key shapes, the caller's header and query values, and the values
                 of fields named like one: proxy/core/errors.py scrub), at most 300
                 characters cut at a word's end (a WebSocket session's 200); else the
                 proxy's own description
  ttfa_ms        time to the first answer token (not reasoning nor tool calls), ms
  reasoning_ms   first to last reasoning read, ms (streams that reasoned)
  reasoning_tokens, reasoning_token_source   reasoning tokens and where the count came from
                 (usage, tokenizer, events)
  tool_calls     the tool calls by outcome ({"complete": 1, "truncated": 1}; logfmt:
                 tool_calls.complete=1), null without calls
  without_answer how an answer that generated but delivered no answer nor call ended
                 (length, stop, error, cancelled; a body not streamed: reasoning alone,
                 length or stop), null otherwise
  conversation   the request's conversation id (a keyed hash, proxy/core/conversations.py:
                 never a header's value), null when not tracked
  turn           its turn in that conversation (1: the first request)
  turn_gap_ms    the previous answer's end -> this request's start, for a continuation
  malformed_events   streamed events that were not a JSON object (as
                 tokenprobe_malformed_events_total counts them), null when none: a client
                 that failed on one and left (client_cancelled) saw a broken stream
  labels         with --label-header only: {label: value}, the bounded values the metrics
                 carry (logfmt: labels.team=...)

A WebSocket session adds one line when its tunnel ends (`session`), shaped like a
request's, its own keys in this order (SESSION_KEYS):

  ts, arrival    when the proxy received the upgrade request, as above
  kind           "websocket_session" (a request's line has no `kind`)
  endpoint       the session's route: its WebSocket API's endpoint (/v1/realtime), else other
  status         what the client got: 101 once the upstream switched, the upstream's refusal,
                 the proxy's own error (400, 502, 503, 504), 0 when no status was seen
  outcome        how it ended (tokenprobe_websocket_sessions_total's outcome)
  e2e_ms         the upgrade request's arrival -> the close of both sides, ms
  error          why the proxy answered the handshake itself (a request line's `error` for
                 the same fault: the address a failed connect tried), else null

A measured session's turns (a realtime utterance) are request lines of their own.

A background Response (`background: true`) whose POST's answer ended before it did (not
streamed: `queued`; or a stream its client left: `in_progress`) has its tokens counted when
a retrieval through the same proxy process first sees it finished (proxy/core/
background.py), and adds one line then (`late_tokens`, LATE_KEYS), after its POST's:

  ts, arrival    when the proxy received the retrieval, as above
  kind           "background_tokens"
  model, endpoint   the POST's, as on its line
  response_id    the response's id (its POST's line has the same)
  finish_reason, raw_finish_reason   how the response ended (stop, length, error, abort;
                 the backend's completed, incomplete, failed, cancelled)
  prompt_tokens, output_tokens, cached_tokens, token_source   the counts added, as a
                 request's (token_source: usage)
  cache_write_tokens   as a request's
  reasoning_tokens, reasoning_token_source   as a request's
  counted_by     the answer that counted them: retrieve (GET /v1/responses/{id}, the
                 stored object) or retrieve_stream (`?stream=true`, its events replayed)
  labels         with --label-header only: the POST's, as on its line

Only these values reach the log: no header value (but a --label-header's bounded label),
no prompt, no completion; but `error` holds what an upstream's error message quotes of the
request (vLLM's validation errors quote the value they refused, up to 200 characters; some
backends echo the whole body), within its 300 characters and credentials masked: the
upstream's words are what tells one error from another. The fingerprint tells which
requests began alike, never what they said: without the salt a guessed prompt cannot be
tested against it, and with a random salt (the default: drawn once per `serve`, shared by
its workers, new at each start) hashes compare only within one run's lines.
"""

from __future__ import annotations

import hashlib
import secrets
import sys
import time
from functools import lru_cache
from typing import Any, TextIO

import orjson

from proxy.core.background import LateTokens
from proxy.core.errors import shown_model
from proxy.core.fingerprint import keyed
from proxy.core.lenient_json import without_surrogates, writable
from proxy.core.measurement import NONE_LABEL, Measurement
from proxy.core.wsrecord import WsSessionRecord
from proxy.sinks.sink import Labels

KEYS = (
    "ts",
    "arrival",
    "model",
    "endpoint",
    "status",
    "error_type",
    "finish_reason",
    "raw_finish_reason",
    "prompt_tokens",
    "output_tokens",
    "cached_tokens",
    "token_source",
    "cache_write_tokens",
    "ttfb_ms",
    "ttft_ms",
    "tpot_ms",
    "decode_tps",
    "e2e_ms",
    "load_ms",
    "queue_ms",
    "engine_ttft_ms",
    "outside_engine_ms",
    "tokens_per_chunk",
    "spec_draft_tokens",
    "spec_accepted_tokens",
    "proxy_overhead_ms",
    "stream",
    "trace_id",
    "response_id",
    "system_fingerprint",
    "error",
    "max_tokens",
    "prefix",
    "prefix_chars",
    "prompt_chars",
    "ttfa_ms",
    "reasoning_ms",
    "reasoning_tokens",
    "reasoning_token_source",
    "tool_calls",
    "without_answer",
    "conversation",
    "turn",
    "turn_gap_ms",
    "malformed_events",
)

SESSION_KEYS = ("ts", "arrival", "kind", "endpoint", "status", "outcome", "e2e_ms", "error")
SESSION_KIND = "websocket_session"
LATE_KEYS = (
    "ts",
    "arrival",
    "kind",
    "model",
    "endpoint",
    "response_id",
    "finish_reason",
    "raw_finish_reason",
    "prompt_tokens",
    "output_tokens",
    "cached_tokens",
    "token_source",
    "cache_write_tokens",
    "reasoning_tokens",
    "reasoning_token_source",
    "counted_by",
)
LATE_KIND = "background_tokens"

_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./:+@")


class AccessLog:
    """A Sink writing one line per request (the raw model name, cut short: a log line
    is no series, so it need not be bounded like a label)."""

    def __init__(
        self,
        mode: str,
        stream: TextIO = sys.stdout,
        attribution: tuple[str, ...] = (),
        salt: str | None = None,
    ) -> None:
        if mode not in ("json", "text"):
            raise ValueError(f"access log mode {mode!r}: expected json or text")
        self.stream = stream
        self.format = _json_line if mode == "json" else _text_line
        self.attribution = attribution  # the --label-header label names
        self.key = salt_key(salt)

    def record(self, m: Measurement, labels: Labels) -> None:
        rec = log_record(m, self.key)
        if self.attribution:
            rec["labels"] = dict(zip(self.attribution, labels.attribution, strict=True))
        # One write and one flush per line: a line reaches the log when its request
        # ends, and lines from several workers on one pipe do not interleave.
        self.stream.write(self.format(rec))
        self.stream.flush()

    def session(self, record: WsSessionRecord) -> None:
        """One line per WebSocket session, when its tunnel ends (SESSION_KEYS)."""
        self.stream.write(self.format(session_record(record)))
        self.stream.flush()

    def late_tokens(self, tokens: LateTokens, labels: Labels) -> None:
        """One line per background Response counted after its POST (LATE_KEYS)."""
        rec = late_record(tokens)
        if self.attribution:
            rec["labels"] = dict(zip(self.attribution, labels.attribution, strict=True))
        self.stream.write(self.format(rec))
        self.stream.flush()


def salt_key(salt: str | None) -> bytes:
    """The BLAKE2b key for prefix hashes: from --log-salt, else random for this process."""
    if salt is None:
        return secrets.token_bytes(32)
    return hashlib.sha256(b"tokenprobe log salt\x00" + salt.encode()).digest()


def log_record(m: Measurement, key: bytes) -> dict[str, Any]:
    """The log record of one request, keys as in KEYS; `key` keys the prefix hashes."""
    prefix = m.prefix
    queue, engine_ttft, outside = m.ttft_parts()
    loaded = m.load_split()  # a stream's load part, scaled with the TTFT as the others are
    load = loaded[0] if loaded is not None else None if m.engine is None else m.engine.load_time
    spec = None if m.engine is None else m.engine.spec
    per_chunk = m.output_tokens_per_chunk()
    return {
        "ts": iso_utc(m.started_at),
        "arrival": round(m.started_at, 6),
        "model": shown_model(m.model),
        "endpoint": m.endpoint,
        "status": m.status_code,
        "error_type": m.error_type.value if m.error_type is not None else None,
        "finish_reason": None if m.finish_reason == NONE_LABEL else m.finish_reason,
        "raw_finish_reason": m.raw_finish_reason,
        "prompt_tokens": m.prompt_tokens,
        "output_tokens": m.output_tokens,
        "cached_tokens": m.cached_prompt_tokens,
        "token_source": m.token_source.value,
        "cache_write_tokens": m.cache_write_tokens,
        "ttfb_ms": _ms(m.ttfb),
        "ttft_ms": _ms(m.ttft),
        "tpot_ms": _ms(m.tpot),
        "decode_tps": None
        if m.decode_tokens_per_second is None
        else round(m.decode_tokens_per_second, 2),
        "e2e_ms": _ms(m.e2e),
        "load_ms": _ms(load),
        "queue_ms": _ms(queue),
        "engine_ttft_ms": _ms(engine_ttft),
        "outside_engine_ms": _ms(outside),
        "tokens_per_chunk": None if per_chunk is None else round(per_chunk, 3),
        "spec_draft_tokens": None if spec is None else spec.draft_tokens,
        "spec_accepted_tokens": None if spec is None else spec.accepted_tokens,
        "proxy_overhead_ms": _ms(m.proxy_overhead),
        "stream": m.stream_requested,
        "trace_id": m.trace_id,
        "response_id": m.response_id,
        "system_fingerprint": m.system_fingerprint,
        "error": m.error_message,
        "max_tokens": m.max_tokens,
        "prefix": None if prefix is None else keyed(prefix, key),
        "prefix_chars": None if prefix is None else list(prefix.chars),
        "prompt_chars": None if prefix is None else prefix.total_chars,
        "ttfa_ms": _ms(m.first_answer),
        "reasoning_ms": _ms(m.reasoning_duration),
        "reasoning_tokens": m.reasoning_tokens,
        "reasoning_token_source": m.reasoning_token_source,
        "tool_calls": m.tool_call_outcomes() or None,
        "without_answer": m.without_answer,
        "conversation": m.conversation_id,
        "turn": m.turn,
        "turn_gap_ms": _ms(m.turn_gap),
        "malformed_events": m.malformed_events or None,
    }


def session_record(record: WsSessionRecord) -> dict[str, Any]:
    """The log record of one WebSocket session, keys as in SESSION_KEYS."""
    return {
        "ts": iso_utc(record.started_at),
        "arrival": round(record.started_at, 6),
        "kind": SESSION_KIND,
        "endpoint": record.route,
        "status": record.status,
        "outcome": record.outcome,
        "e2e_ms": _ms(record.duration),
        "error": record.error,
    }


def late_record(t: LateTokens) -> dict[str, Any]:
    """The log record of a background Response's tokens, keys as in LATE_KEYS."""
    return {
        "ts": iso_utc(t.started_at),
        "arrival": round(t.started_at, 6),
        "kind": LATE_KIND,
        "model": shown_model(t.model),
        "endpoint": t.endpoint,
        "response_id": t.response_id,
        "finish_reason": None if t.finish_reason == NONE_LABEL else t.finish_reason,
        "raw_finish_reason": t.raw_finish_reason,
        "prompt_tokens": t.prompt_tokens,
        "output_tokens": t.output_tokens,
        "cached_tokens": t.cached_prompt_tokens,
        "token_source": t.token_source.value,
        "cache_write_tokens": t.cache_write_tokens,
        "reasoning_tokens": t.reasoning_tokens,
        "reasoning_token_source": t.reasoning_token_source,
        "counted_by": t.counted_by,
    }


def iso_utc(seconds: float) -> str:
    """1700000000.1234 -> '2023-11-14T22:13:20.123Z'."""
    whole, ms = divmod(int(seconds * 1000), 1000)
    return _whole_seconds(whole) + f".{ms:03d}Z"


@lru_cache(maxsize=4)  # the lines of one second share it: strftime is most of iso_utc's time
def _whole_seconds(whole: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


#: The line breaks besides the ASCII ones (those JSON escapes): a reader that splits on
#: every Unicode line break (Python's str.splitlines) would read a client's U+2028 in a
#: model name as the start of a line it wrote.
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def _one_line(line: str) -> str:
    return line if line.isascii() else line.translate(_LINE_BREAKS)


def _json_line(rec: dict[str, Any]) -> str:
    try:
        line = orjson.dumps(rec, option=orjson.OPT_APPEND_NEWLINE)
    except orjson.JSONEncodeError:
        # A value orjson will not write, from a request read by json.loads (vLLM's reader,
        # proxy/core/lenient_json.py): a string with a lone surrogate, an integer beyond
        # 64 bits (`"max_tokens": 1e23` as digits). The line is written with U+FFFD and
        # the digits as a string rather than lost.
        writable(rec)
        line = orjson.dumps(rec, option=orjson.OPT_APPEND_NEWLINE)
    return _one_line(line.decode())


def _text_line(rec: dict[str, Any]) -> str:
    """logfmt: `key=value` pairs, values with spaces, quotes or '=' JSON-quoted."""
    parts: list[str] = []
    for key, value in rec.items():
        if value is None:
            continue
        if isinstance(value, dict):
            parts.extend(f"{key}.{k}={v}" for k, v in value.items())  # sanitised label values
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, list):
            text = ",".join(str(v) for v in value)
        elif isinstance(value, str):
            plain = value and _PLAIN.issuperset(value)
            text = value if plain else orjson.dumps(without_surrogates(value)).decode()
        else:
            text = str(value)
        parts.append(f"{key}={text}")
    # A lone surrogate elsewhere (a label, a list) would fail the stream's UTF-8 write.
    return _one_line(without_surrogates(" ".join(parts) + "\n"))
