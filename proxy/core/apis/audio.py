"""vLLM's speech to text: `POST /v1/audio/transcriptions` and `/v1/audio/translations`.

Wire facts (vllm-project/vllm: vllm/entrypoints/speech_to_text/base/serving.py @
00e2ed95ef60, `_speech_to_text_stream_generator`; transcription/ and translation/
protocol.py): the request is a multipart form (`file`, `model`, `stream`,
`stream_include_usage`, `stream_continuous_usage_stats`, `temperature`, ...). A stream is
SSE of `{"id", "object": "transcription.chunk" | "translation.chunk", "created", "model",
"choices": [{"delta": {"content": ...}}]}`, the last choice with `finish_reason` and
`stop_reason`; then, only when `stream_include_usage` is true (or the server was started
with `--enable-force-include-usage`), a usage chunk with `"choices": []` and `usage`
(`prompt_tokens` counts the decoder prompt plus the audio's tokens), then `data: [DONE]`.
An error after the 200 is `data: {"error": ...}` before [DONE]. Not streamed, a
transcription is `{"text", "usage": {"type": "duration", "seconds"}}` (no token counts)
and a translation `{"text"}`.

Usage: when the client streams without `stream_include_usage`, the proxy adds that one
field as a last form part (proxy/core/form.py) and strips the usage-only chunk again
(proxy/core/strip.py), exactly as for chat: the client gets the bytes it would get direct.
A client that sent the field itself (true or false) is left alone, and so is one that
asked for continuous usage (see Transcriptions.ask_for_usage).
"""

from __future__ import annotations

from typing import Any

from proxy.core.apis.base import Facts, RequestInfo
from proxy.core.apis.chat import Chat, keep
from proxy.core.form import Form, read_form, with_field
from proxy.core.lax import lax_bool

USAGE_FIELD = "stream_include_usage"
CONTINUOUS_FIELD = "stream_continuous_usage_stats"


class Transcriptions(Chat):
    endpoint = "/v1/audio/transcriptions"
    bench_name = "transcriptions"
    takes_messages = False  # a form with a file, not the chat it derives from
    paths = ("/v1/audio/transcriptions",)
    operation = "transcription"
    # Audio longer than the model's clip is transcribed in segments, each one's last chunk
    # with its own finish_reason (base/serving.py loops over the segments' generators):
    # only [DONE], which vLLM always sends, ends the stream.
    finish_ends_stream = False
    end_marker = "[DONE]"
    measures = (
        "multipart form read with a real parser; TTFT at the first transcription.chunk with "
        "non-empty delta.content; TPOT, ITL, decode speed; tokens from the usage chunk "
        "(stream_include_usage added to the form when the client did not send it, and the "
        "chunk stripped again), finish_reason, in-stream errors"
    )

    def decode(self, body: bytes, content_type: bytes) -> dict[str, Any] | None:
        return read_form(body, content_type)

    def decode_leniently(self, body: bytes, content_type: bytes) -> dict[str, Any] | None:
        return None  # a form or nothing: vLLM's audio routes read no JSON

    def read_request(self, obj: dict[str, Any]) -> RequestInfo:
        model = obj.get("model")
        return RequestInfo(
            endpoint=self.endpoint,
            model=model if isinstance(model, str) else "",
            stream=_flag(obj.get("stream")),
            usage_requested=self.usage_requested(obj),
            max_tokens=_number(obj.get("max_completion_tokens"), int),
            temperature=_number(obj.get("temperature"), float),
        )

    def usage_requested(self, obj: dict[str, Any]) -> bool:
        return _flag(obj.get(USAGE_FIELD))

    def ask_for_usage(self, obj: dict[str, Any], body: bytes) -> bytes | None:
        """The form with `stream_include_usage` added, or None: where the client sent it,
        and where it sent `stream_continuous_usage_stats` true, which vLLM honours only
        beside include_usage (base/serving.py, `include_continuous_usage =
        request.stream_continuous_usage_stats if include_usage else False`): asked for,
        usage would come on every chunk, which the client would not get direct. Chat
        sends that flag as false instead; a form part is not rewritten here."""
        if not isinstance(obj, Form) or USAGE_FIELD in obj or _flag(obj.get(CONTINUOUS_FIELD)):
            return None
        return with_field(obj, USAGE_FIELD, "true")

    def body(self, obj: dict[str, Any], collect: bool) -> Facts:
        facts = Facts()  # the duration usage has no token counts: a tokenizer may count
        text = obj.get("text")
        if collect and type(text) is str:
            keep(facts, text)
        return facts


class Translations(Transcriptions):
    endpoint = "/v1/audio/translations"
    bench_name = "translations"
    paths = ("/v1/audio/translations",)
    operation = "translation"
    measures = Transcriptions.measures.replace("transcription.chunk", "translation.chunk")


def _flag(value: object) -> bool:
    """A form field vLLM reads as true (a form's values are texts; pydantic's lax bool)."""
    return isinstance(value, str) and lax_bool(value) is True


def _number(value: object, kind: type[int] | type[float]) -> Any:
    if not isinstance(value, str):
        return None
    try:
        return kind(value)
    except ValueError:
        return None
