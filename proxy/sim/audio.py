"""vLLM's speech to text (`/v1/audio/transcriptions`, `/v1/audio/translations`) on the wire.

Source: vllm-project/vllm vllm/entrypoints/speech_to_text/base/serving.py @ 00e2ed95ef60
(`_speech_to_text_stream_generator`, the non-streamed branch of `_create_speech_to_text`)
and transcription/translation protocol.py. Chunks are `model_dump_json(exclude_unset=True)`:

  content  {"id","object":"transcription.chunk","created","model",
            "choices":[{"delta":{"content":"<text>"}}]}
  finish   ... "choices":[{"delta":{"content":""},"finish_reason":"stop","stop_reason":null}]
           (a transcript cut by its token limit ends on its last content chunk instead:
           `"delta":{"content":"<text>"},"finish_reason":"length"`, as chat's, stream.py)
  usage    ... "choices":[],"usage":{"prompt_tokens","total_tokens","completion_tokens"}
           only when the form says stream_include_usage=true (exclude_none)
  then     data: [DONE]

(`translation.chunk` for translations.) Not streamed: a transcription is
`{"text","usage":{"type":"duration","seconds":<ceil(audio seconds)>}}`, a translation `{"text"}`.

The transcript is programmed, as every simulated completion: token i is `VOCAB[i]`. The
audio is not decoded: its length in seconds is the file's size over 32 000 bytes (16 kHz
PCM16 mono), and the prompt counts one token per 20 ms of it plus 4 decoder-prompt tokens.
A request without a `file` part, or a body that is not a form, is answered 400 as vLLM's
validation handler does.
"""

from __future__ import annotations

import math
from typing import Any

import orjson

from proxy.core.form import Form, read_form
from proxy.core.wav import BYTES_PER_SECOND


class AudioInputError(ValueError):
    pass


def form_body(raw: bytes, content_type: str) -> dict[str, Any]:
    """The form read as a completion request, for the plan (controls.plan_request)."""
    form: Form | None = read_form(raw, content_type.encode("latin-1"))
    if form is None:
        raise AudioInputError("Invalid multipart form data.")
    if not form.file_bytes:
        raise AudioInputError("Field required: file")
    seconds = form.file_bytes / BYTES_PER_SECOND
    true = ("true", "1", "yes", "on")
    return {
        "model": form.get("model"),
        "stream": form.get("stream", "").lower() in true,
        "stream_options": {
            "include_usage": form.get("stream_include_usage", "").lower() in true,
            "continuous_usage_stats": form.get("stream_continuous_usage_stats", "").lower() in true,
        },
        "prompt": [0] * (4 + math.ceil(seconds * 50)),
        "audio_seconds": seconds,
    }


class AudioWire:
    """The chunks of one transcription or translation stream (chat's shape, no index; no
    system_fingerprint and no metrics object: the speech protocol has neither)."""

    __slots__ = ("_head", "fingerprint")

    def __init__(self, translation: bool, response_id: str, created: int, model: str) -> None:
        self.fingerprint: bytes | None = None
        obj = b"translation.chunk" if translation else b"transcription.chunk"
        self._head = b'data: {"id":%s,"object":"%s","created":%d,"model":%s' % (
            orjson.dumps(response_id),
            obj,
            created,
            orjson.dumps(model),
        )

    def content(self, text: bytes, usage: bytes | None = None, index: int = 0) -> bytes:
        return self._head + b',"choices":[{"delta":{"content":"' + text + b'"}}]' + _tail(usage)

    def last(
        self,
        text: bytes,
        finish_reason: str,
        usage: bytes | None = None,
        fingerprint: bytes | None = None,
        index: int = 0,
        stop_reason: str | None = None,
    ) -> bytes:
        """The last token's chunk with the finish (the stream generator sends the finish
        with the output that carries it, as chat does)."""
        return (
            self._head
            + b',"choices":[{"delta":{"content":"'
            + text
            + b'"},"finish_reason":%s,"stop_reason":%s}]'
            % (orjson.dumps(finish_reason), orjson.dumps(stop_reason))
            + _tail(usage)
        )

    def finish(
        self,
        finish_reason: str,
        usage: bytes | None = None,
        fingerprint: bytes | None = None,
        index: int = 0,
    ) -> bytes:
        return self.last(b"", finish_reason, usage)

    def usage(
        self, usage: bytes, fingerprint: bytes | None = None, metrics: bytes | None = None
    ) -> bytes:
        return self._head + b',"choices":[],"usage":' + usage + b"}\n\n"


def full(translation: bool, text: str, seconds: float) -> bytes:
    if translation:
        return orjson.dumps({"text": text})
    return orjson.dumps(
        {"text": text, "usage": {"type": "duration", "seconds": math.ceil(seconds)}}
    )


def _tail(usage: bytes | None) -> bytes:
    return b"}\n\n" if usage is None else b',"usage":' + usage + b"}\n\n"
