"""vLLM's realtime transcription, the WebSocket `/v1/realtime`, on the WebSocket seam.

Wire facts (vllm-project/vllm vllm/entrypoints/speech_to_text/realtime/protocol.py @
c6088cb14ab5 and connection.py @ 8ba6842cb276): every message is a JSON text frame with a
`type`. The server opens with `session.created` (id, created); the client sends
`session.update` (model), `input_audio_buffer.append` (`audio`: base64 PCM16, 16 kHz,
mono) and `input_audio_buffer.commit`: a commit without `final` starts a generation (one
at a time: a commit while one runs is ignored), `final: true` says the audio is over. The
server streams `transcription.delta` (`delta`) and ends with `transcription.done`
(`text`, `usage`: prompt_tokens, completion_tokens); it answers `error` (`error`, `code`)
for a frame that is not JSON (invalid_json), an unknown event, bad audio, a model not
validated or not found, and a failed generation (processing_error, then no done).

One Measurement per utterance: from the client's commit that started the generation
(start) to the first non-empty `transcription.delta` (TTFT) and to `transcription.done`
(e2e), tokens from its usage (else the deltas counted, source chunks), the audio seconds
appended for it in `audio_seconds`. A `processing_error` ends the open utterance
as `stream_error`, unless a client event vLLM's models refuse is waiting for its answer:
vLLM answers that one with a `processing_error` too (connection.py, handle_connection:
any exception from handle_event), and the generation runs on; a commit it would refuse,
sent before any model was validated, is answered `model_not_validated` instead. The proxy reads a client
event as vLLM does: the frame with `json.loads` (JSON that is no object fails at
`event.get`, a refusal), the event's fields as those models do (pydantic, lax: `audio` a
string, `final` a bool or one of pydantic's words for one, `"true"`, `1`, `"no"`...).
session.update's `model` is vLLM's to check: a refused one answers model_not_found, a
taken one nothing, and an utterance is labelled with the last model taken before its
commit. `json.loads` takes a lone surrogate ("\\ud800"), which no UTF-8 encoder takes:
vLLM's answer that would quote one (a model's model_not_found, an unknown type's
unknown_event) fails pydantic's serialisation and is a processing_error instead (a
refusal); the event's strings are read with each one replaced by U+FFFD. Any other
`error` is a record of its own (`not_found` for model_not_found, else `bad_request`; a
refused commit opens no utterance); a session that
ends with an utterance open records it as `stream_truncated`, saying how the session
ended. A frame that is not a JSON object is counted (`malformed`) and passes, as every
byte does. The session keeps its own figures (`utterances`, `audio_seconds`, `duration`).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl

from proxy.core.apis.base import json_object
from proxy.core.errors import scrub
from proxy.core.lax import lax_bool
from proxy.core.lenient_json import clean_surrogates, without_surrogates
from proxy.core.measurement import NONE_LABEL, ErrorType, Measurement, TokenSource
from proxy.core.wav import BYTES_PER_SECOND
from proxy.core.wsbase import WsApi, WsSession
from proxy.core.wsframes import WsMessage


class Realtime(WsApi):
    endpoint = "/v1/realtime"
    bench_name = "realtime"
    paths = ("/v1/realtime",)
    operation = "transcription"  # as /v1/audio/transcriptions (proxy/core/apis/audio.py)

    def open(
        self,
        *,
        start: float,
        started_at: float,
        path: str,
        query: str,
        record: Callable[[Measurement], None],
    ) -> RealtimeSession:
        return RealtimeSession(start, started_at, _model_in(query), record)


class _Utterance:
    __slots__ = ("asked", "audio", "commit", "deltas", "first", "gaps", "last")

    def __init__(self, commit: float, audio: int, asked: int = 0) -> None:
        self.commit, self.audio = commit, audio
        self.asked = asked  # the session.update models asked for before its commit
        self.first: float | None = None
        self.last: float | None = None
        self.deltas = 0
        self.gaps: list[float] = []  # between one non-empty delta and the next: the ITLs


class RealtimeSession(WsSession):
    def __init__(
        self, start: float, started_at: float, model: str, record: Callable[[Measurement], None]
    ) -> None:
        self.start, self.started_at, self.model, self.record = start, started_at, model, record
        self.current: _Utterance | None = None  # the generation running now
        self.utterances = 0
        self.audio_bytes = 0
        self._pending_audio = 0  # appended while no generation runs
        # Client events vLLM's models refuse, not yet answered, in order: "commit" for a
        # commit whose `final` it cannot read, "event" for any other. vLLM answers each
        # with a processing_error, except a commit before any model was validated: that
        # one gets model_not_validated before its fields are read (connection.py,
        # handle_event), so it is answered by that instead.
        self._refusals: deque[str] = deque()
        # The models session.update asked for, in order, each with whether vLLM refused it
        # (model_not_found). vLLM answers only a refusal, and it answers it before it reads
        # the client's next event: an utterance's model is the last one asked for before
        # its commit and not refused, known by its end.
        self._asked: list[list[Any]] = []
        self.malformed = 0
        self.duration: float | None = None
        self.session_id: str | None = None

    @property
    def audio_seconds(self) -> float:
        return self.audio_bytes / BYTES_PER_SECOND

    def message(self, msg: WsMessage) -> None:
        if msg.kind != "text":
            return
        obj = json_object(msg.data)
        if obj is None:
            self.malformed += 1
            if not msg.from_client:
                return
            event = _as_vllm_reads(msg.data)
            if event is _NOT_JSON:
                return  # vLLM answers invalid_json, an error of its own
            if type(event) is not dict:
                self._refusals.append("event")  # vLLM's `event.get` fails: processing_error
                return
            self.malformed -= 1  # JSON to vLLM's reader (NaN, Infinity, "\ud800"): an event
            if _answer_quotes_a_surrogate(event):
                self._refusals.append("event")  # its answer cannot be sent: processing_error
                return
            clean_surrogates(event)  # what is read from here on (and recorded) encodes
            obj = event
        kind = obj.get("type")
        u = self.current
        if msg.from_client:
            if kind == "input_audio_buffer.append":
                audio = obj.get("audio")
                if type(audio) is not str:
                    self._refusals.append("event")
                    return
                size = _pcm_size(audio)
                if size == 0 or size % 2:
                    return  # vLLM answers invalid_audio and queues nothing: no audio
                self.audio_bytes += size
                if u is None:
                    self._pending_audio += size
                else:
                    u.audio += size
            elif kind == "input_audio_buffer.commit":
                final = lax_bool(obj.get("final", False))
                if final is None:
                    self._refusals.append("commit")
                elif not final and u is None:
                    self.current = _Utterance(msg.at, self._pending_audio, len(self._asked))
                    self._pending_audio = 0
            elif kind == "session.update":
                # vLLM checks the model as sent (connection.py, handle_event): a name it does
                # not serve, or any other value that is not empty, is model_not_found; an
                # empty one (0, "", []) passes. Only a name can become the label.
                model = obj.get("model")
                if model and type(model) is str:
                    self._asked.append([model, False])
                    if len(self._asked) > _MAX_ASKED:  # a client that never commits
                        oldest, refused = self._asked.pop(0)
                        self.model = self.model if refused else oldest
                        if self.current is not None:
                            self.current.asked = max(0, self.current.asked - 1)
            return
        if kind == "transcription.delta":
            delta = obj.get("delta")
            if u is not None and delta and type(delta) is str:
                if u.first is None:
                    u.first = msg.at
                elif u.last is not None:
                    u.gaps.append(msg.at - u.last)
                u.last = msg.at
                u.deltas += 1
        elif kind == "transcription.done":
            if u is not None:
                self.current = None
                self._finish(u, msg.at, obj.get("usage"), None, None)
        elif kind == "error":
            self._error(obj, msg.at)
        elif kind == "session.created":
            sid = obj.get("id")
            self.session_id = sid if type(sid) is str else None

    def _error(self, obj: dict[str, Any], at: float) -> None:
        code, text = obj.get("code"), obj.get("error")
        # Whole: the tunnel masks the session's own credentials in it before it cuts it
        # (proxy/server/tunnel/session.py `_record`); a cut here would leave the start of
        # a key that straddles it, which no masking recognises then.
        message = scrub(f"{code}: {text}" if code else str(text))
        u = self.current
        if code == "processing_error" and self._refusals:
            self._refusals.popleft()  # the answer to a refused client event, not to u
            u = None
        elif code == "model_not_validated" and "commit" in self._refusals:
            self._refusals.remove("commit")  # a refused commit's answer, before validation
        elif u is not None and code == "processing_error":
            self.current = None
            self._finish(u, at, None, ErrorType.STREAM_ERROR, message)
            return
        if u is not None and code == "model_not_validated" and u.deltas == 0:
            self.current = None  # the commit that opened it was refused
            self._pending_audio += u.audio
        refused = self._refuse(str(text)) if code == "model_not_found" else None
        error = ErrorType.NOT_FOUND if code == "model_not_found" else ErrorType.BAD_REQUEST
        self._finish(_Utterance(at, 0, len(self._asked)), at, None, error, message, False, refused)

    def _refuse(self, text: str) -> str | None:
        """vLLM refused a session.update's model ("The model `X` does not exist."): the
        oldest one asked for and not yet refused that the message names; returns its name.
        None when it names none of them: the model refused was no name (123, which is
        never tracked), and every name asked for still stands."""
        entry = next(
            (entry for entry in self._asked if not entry[1] and f"`{entry[0]}`" in text), None
        )
        if entry is None:
            return None
        entry[1] = True
        return str(entry[0])

    def _model_of(self, u: _Utterance, utterance: bool) -> str:
        """The model of a record: the last model asked for before it and not refused, else
        the session's. An utterance's end settles the ones asked for before its commit."""
        model = next(
            (name for name, refused in reversed(self._asked[: u.asked]) if not refused),
            self.model,
        )
        if utterance:
            self.model = model
            del self._asked[: u.asked]
        return str(model)

    def close(self, at: float, cause: str) -> None:
        self.duration = at - self.start
        u, self.current = self.current, None
        if u is not None:
            message = f"session ended ({cause}) before transcription.done"
            # the client went away first, as an HTTP client that hangs up mid-stream
            gone = cause in ("closed_by_client", "client_vanished")
            error = ErrorType.CLIENT_CANCELLED if gone else ErrorType.STREAM_TRUNCATED
            self._finish(u, at, None, error, message)

    def refused(self, at: float, status: int, error: ErrorType, message: str) -> None:
        self._finish(_Utterance(self.start, 0), at, None, error, message, False, status=status)

    def _finish(
        self,
        u: _Utterance,
        end: float,
        usage: Any,
        error: ErrorType | None,
        message: str | None,
        utterance: bool = True,
        model: str | None = None,
        status: int = 101,
    ) -> None:
        """Record `u`; `model`, when given, is its label, else `_model_of`. `status`: the
        upgrade's, 101 but for a refused one (`refused`), whose answer is its first byte."""
        if model is None:
            model = self._model_of(u, utterance)
        self.utterances += utterance
        prompt = output = None
        source = TokenSource.CHUNKS if u.deltas else TokenSource.NONE
        if type(usage) is dict and type(usage.get("completion_tokens")) is int:
            output, source = usage["completion_tokens"], TokenSource.USAGE
            prompt = usage.get("prompt_tokens") if type(usage.get("prompt_tokens")) is int else None
        elif u.deltas:
            output = u.deltas
        tpot = tps = None
        if output is not None and output >= 2 and u.first is not None and u.last is not None:
            span = u.last - u.first
            tpot = span / (output - 1)
            tps = (output - 1) / span if span > 0 else None
        self.record(
            Measurement(
                endpoint=Realtime.endpoint,
                model=model,
                stream=True,
                stream_requested=True,
                status_code=status,
                started_at=self.started_at + (u.commit - self.start),
                ttfb=None if status == 101 else end - u.commit,
                ttft=None if u.first is None else u.first - u.commit,
                tpot=tpot,
                decode_tokens_per_second=tps,
                e2e=end - u.commit,
                inter_token_latencies=tuple(u.gaps),
                prompt_tokens=prompt,
                output_tokens=output,
                cached_prompt_tokens=None,
                token_source=source,
                content_events=u.deltas,
                finish_reason=NONE_LABEL,
                error_type=error,
                error_message=message,
                response_id=self.session_id,
                audio_seconds=u.audio / BYTES_PER_SECOND,
            )
        )


#: The session.update models kept until an utterance settles them: more, and the oldest
#: is settled as if vLLM had taken it (a client that updates and never commits).
_MAX_ASKED = 32


def _as_vllm_reads(data: bytes) -> Any:
    """A client frame that is no JSON object to orjson, as vLLM reads it (connection.py,
    handle_connection: `receive_text()`, then `json.loads` of that str, which also takes
    NaN and Infinity): the value, or _NOT_JSON when it is no JSON (vLLM answers
    invalid_json). The text is UTF-8, strictly: `json.loads` of bytes would also take a
    BOM or UTF-16, which `json.loads` of the str refuses."""
    try:
        return json.loads(data.decode("utf-8"))
    except ValueError:  # JSONDecodeError, or UnicodeDecodeError: bytes that are no text
        return _NOT_JSON


_NOT_JSON = object()


def _answer_quotes_a_surrogate(event: dict[str, Any]) -> bool:
    """vLLM's answer to this event would quote a lone surrogate: an unknown `type`
    ("Unknown event type: ..."; no known one holds a surrogate), or a session.update's
    model (no served name holds one either, so "The model `...` does not exist."). Its
    ErrorEvent's `model_dump_json()` then raises PydanticSerializationError ("surrogates
    not allowed"), and handle_connection's `except Exception` answers processing_error
    (vLLM 0.32 realtime/connection.py:76-78, 115, 163, 280-283)."""
    kind = event.get("type")
    if type(kind) is str and without_surrogates(kind) is not kind:
        return True
    model = event.get("model") if kind == "session.update" else None
    return type(model) is str and without_surrogates(model) is not model


_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_NOT_ALPHABET = bytes(sorted(set(range(128)) - set(_ALPHABET)))


def _pcm_size(audio: str) -> int:
    """The bytes vLLM decodes from an append's `audio` (connection.py: pybase64's
    `b64decode`, which drops every character outside the base64 alphabet, then wants
    the padding a quantum's remainder needs), counted, not decoded: this runs on every
    append. 0 where pybase64 refuses it (vLLM answers invalid_audio)."""
    if not audio.isascii():
        return 0  # pybase64 refuses a str that is not ASCII
    raw = audio.encode("ascii")
    n = len(raw) - len(raw.translate(None, _ALPHABET))  # the alphabet's characters
    short = n % 4
    if short == 1:
        return 0  # "Invalid number of data characters"
    if short:  # 2 or 3 characters in the last quantum: it needs 2 or 1 "=" after them
        tail = raw[len(raw.rstrip(_NOT_ALPHABET)) :]
        if tail.count(b"=") < 4 - short:
            return 0  # "Incorrect padding"
    return n * 3 // 4


def _model_in(query: str) -> str:
    """The session's model as the query names it (`?model=`, as OpenAI's realtime URL
    does), decoded as starlette's `query_params` decodes it (parse_qsl: percent-escapes
    and `+`, and the last of several): `openai%2Fwhisper` is `openai/whisper`."""
    models = [value for name, value in parse_qsl(query, keep_blank_values=True) if name == "model"]
    return models[-1] if models else ""
