"""vLLM's realtime transcription, the WebSocket `/v1/realtime`, on the WebSocket seam.

Wire facts (vllm-project/vllm vllm/entrypoints/speech_to_text/realtime/protocol.py @
c6088cb14ab5, connection.py): every message is a JSON text frame with a `type`. The
server opens with `session.created` (id, created); the client sends `session.update`
(model), `input_audio_buffer.append` (`audio`: base64 PCM16, 16 kHz, mono) and
`input_audio_buffer.commit` (`final`); the server answers `transcription.delta` (`delta`)
and `transcription.done` (`text`, `usage`: prompt_tokens, completion_tokens), and
`error` (`error`, `code`) when something fails.

One Measurement per utterance: from the client's commit (start) to the first non-empty
`transcription.delta` (TTFT) and to `transcription.done` (e2e), tokens from its usage
(else the deltas counted, source chunks), `audio_seconds` (appended since the previous
commit) in `extra`. Utterances are answered in order, so deltas and done belong to the
oldest open one. An `error` ends the oldest open utterance as `stream_error` (or, with none
open, is recorded on its own); a session that ends with an utterance still open records it
as `stream_truncated`, saying how the session ended. A frame that is not a JSON object is
counted (`malformed`) and passes, as every byte does. The session keeps its own figures
(`utterances`, `audio_bytes`, `audio_seconds`, `duration`) for the session metrics.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from proxy.core.apis.base import json_object
from proxy.core.measurement import NONE_LABEL, ErrorType, Measurement, TokenSource
from proxy.core.wsbase import WsApi, WsSession
from proxy.core.wsframes import WsMessage

#: PCM16 at 16 kHz, mono.
BYTES_PER_SECOND = 32_000


class Realtime(WsApi):
    endpoint = "/v1/realtime"
    paths = ("/v1/realtime",)

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
    __slots__ = ("audio", "commit", "deltas", "first", "last")

    def __init__(self, commit: float, audio: int) -> None:
        self.commit, self.audio = commit, audio
        self.first: float | None = None
        self.last: float | None = None
        self.deltas = 0


class RealtimeSession(WsSession):
    def __init__(
        self, start: float, started_at: float, model: str, record: Callable[[Measurement], None]
    ) -> None:
        self.start, self.started_at, self.model, self.record = start, started_at, model, record
        self.open_utterances: deque[_Utterance] = deque()
        self.utterances = 0
        self.audio_bytes = 0
        self._pending_audio = 0  # appended since the last commit
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
            return
        kind = obj.get("type")
        if msg.from_client:
            if kind == "input_audio_buffer.append":
                audio = obj.get("audio")
                if type(audio) is str:
                    size = _b64_size(audio)
                    self.audio_bytes += size
                    self._pending_audio += size
            elif kind == "input_audio_buffer.commit":
                self.open_utterances.append(_Utterance(msg.at, self._pending_audio))
                self._pending_audio = 0
            elif kind == "session.update":
                model = obj.get("model")
                if type(model) is str and model:
                    self.model = model
            return
        if kind == "transcription.delta":
            delta = obj.get("delta")
            if self.open_utterances and delta and type(delta) is str:
                u = self.open_utterances[0]
                if u.first is None:
                    u.first = msg.at
                u.last = msg.at
                u.deltas += 1
        elif kind == "transcription.done":
            if self.open_utterances:
                usage = obj.get("usage")
                self._finish(self.open_utterances.popleft(), msg.at, usage, None, None)
        elif kind == "error":
            text = obj.get("error")
            code = obj.get("code")
            message = f"{code}: {text}" if code else str(text)
            u = self.open_utterances.popleft() if self.open_utterances else _Utterance(msg.at, 0)
            self._finish(u, msg.at, None, ErrorType.STREAM_ERROR, message[:200])
        elif kind == "session.created":
            sid = obj.get("id")
            self.session_id = sid if type(sid) is str else None

    def close(self, at: float, cause: str) -> None:
        self.duration = at - self.start
        while self.open_utterances:
            self._finish(
                self.open_utterances.popleft(),
                at,
                None,
                ErrorType.STREAM_TRUNCATED,
                f"session ended ({cause}) before transcription.done",
            )

    def _finish(
        self,
        u: _Utterance,
        end: float,
        usage: Any,
        error: ErrorType | None,
        message: str | None,
    ) -> None:
        self.utterances += 1
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
                model=self.model,
                stream=True,
                status_code=101,
                started_at=self.started_at + (u.commit - self.start),
                ttfb=None,
                ttft=None if u.first is None else u.first - u.commit,
                tpot=tpot,
                decode_tokens_per_second=tps,
                e2e=end - u.commit,
                inter_token_latencies=(),
                prompt_tokens=prompt,
                output_tokens=output,
                cached_prompt_tokens=None,
                token_source=source,
                content_events=u.deltas,
                finish_reason=NONE_LABEL,
                error_type=error,
                error_message=message,
                response_id=self.session_id,
                extra={"audio_seconds": u.audio / BYTES_PER_SECOND},
            )
        )


def _b64_size(text: str) -> int:
    """Decoded size of a base64 string, without decoding it."""
    n = len(text)
    pad = 2 if text.endswith("==") else 1 if text.endswith("=") else 0
    return max(0, n * 3 // 4 - pad)


def _model_in(query: str) -> str:
    for pair in query.split("&"):
        name, _, value = pair.partition("=")
        if name == "model":
            return value
    return ""
