"""vLLM's realtime transcription (`/v1/realtime`, a WebSocket) as a raw ASGI session.

Source: vllm-project/vllm vllm/entrypoints/speech_to_text/realtime/connection.py @
8ba6842cb276 and protocol.py @ c6088cb14ab5. Events are `model_dump_json()` (every field,
nulls included), one text frame each:

  on accept        {"type":"session.created","id":"sess-<hex>","created":<s>}
  session.update   checks `model` (missing or null: error invalid_event; unknown:
                   model_not_found; empty, "" or any falsy value, is every model: serve/
                   engine/serving.py:86-88 `if not model_name: return True`)
  ...append        base64 PCM16 16 kHz mono, decoded as pybase64 decodes without
                   validation (connection.py:121: characters outside the alphabet, line
                   breaks included, are dropped); undecodable, empty or an odd number of
                   bytes (np.frombuffer int16, :123-126): error invalid_audio; `audio` not a
                   string: pydantic's error, processing_error (:119)
  ...commit        not validated yet: error model_not_validated; `final` read as pydantic
                   reads a bool (protocol.py:26, lax: 1, "true", "yes", "on" are true), one
                   it refuses is a processing_error (:156); final: the audio is over; else
                   starts a generation unless one runs (then it is ignored)
  not JSON         error invalid_json; JSON but no object: error processing_error (vLLM's
                   `event.get` raises); an unknown type: error unknown_event
  a lone surrogate in an answer (the model or type of the event, read from a
                   "\\ud800" escape): pydantic cannot write it, and the answer is a
                   processing_error "Error serializing to JSON: UnicodeEncodeError: ..."
  a binary frame   ends the session: vLLM's `receive_text()` (connection.py:70, outside
                   the per-event try) raises KeyError (starlette websockets.py:127
                   `message["text"]`), handle_connection returns without a close frame,
                   and uvicorn drops the connection: the client sees 1006

A generation is the programmed transcript: token i is `VOCAB[i]`, the first delta at
commit + ttft, then one every 1/tps, each `{"type":"transcription.delta","delta":...}`;
after the last one and the final commit, `{"type":"transcription.done","text",
"usage":{"prompt_tokens","total_tokens","completion_tokens","prompt_tokens_details":null}}`
(prompt: 4 tokens plus one per 20 ms of audio). Errors: {"type":"error","error","code"}.

Programmed by the upgrade request's headers, as the HTTP routes: x-sim-ttft, x-sim-tps,
x-sim-output-tokens, and x-sim-fault (with x-sim-fault-after deltas): error_event (a
processing_error, no done), close_no_done (the server closes with 1011 mid-utterance),
malformed (a text frame that is not JSON, then the generation goes on), stall
(x-sim-stall seconds of silence). Every text frame sent is kept in `sent` for tests.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import math
import re
import time
import uuid
from typing import Any

import orjson
from starlette.types import Receive, Scope, Send

from proxy.core.lax import lax_bool
from proxy.core.wav import BYTES_PER_SECOND
from proxy.sim.config import SimConfig
from proxy.sim.controls import ControlError, number
from proxy.sim.tokens import VOCAB

WS_FAULTS = frozenset({"error_event", "close_no_done", "malformed", "stall"})
PROCESSING = "processing_error"
#: What pybase64 drops from the text it decodes without validation.
_NOT_BASE64 = re.compile(r"[^A-Za-z0-9+/=]")
#: pydantic's error pages, as vLLM 0.32's pydantic (2.14) names them.
_PYDANTIC_ERRORS = "https://errors.pydantic.dev/2.14/v/"


def pcm16_bytes(audio: str) -> int | None:
    """The bytes of PCM16 in `audio`, as vLLM reads an append (connection.py:121-135:
    pybase64.b64decode without validation, then np.frombuffer as int16), None where it
    answers invalid_audio: not ASCII, badly padded, empty, or an odd number of bytes.
    Checked against pybase64 1.5.1 for line-wrapped text (accepted), blanks and other
    characters outside the alphabet (dropped), excess `=` at the end (dropped), missing
    padding and data between two padded groups (refused)."""
    if not audio.isascii():
        return None
    text = _NOT_BASE64.sub("", audio)
    if text.endswith("="):  # excess padding at the end is dropped
        text = text.rstrip("=")
        text += "=" * (-len(text) % 4)
    try:
        size = len(base64.b64decode(text, validate=True))
    except (binascii.Error, ValueError):
        return None
    return size if size and size % 2 == 0 else None


def _pydantic(model: str, field: str, message: str, kind: str, value: Any) -> str:
    """pydantic's ValidationError text for one field, as vLLM sends it (str(e))."""
    shown = repr(value)
    return (
        f"1 validation error for {model}\n{field}\n  {message} [type={kind}, "
        f"input_value={shown}, input_type={type(value).__name__}]\n"
        f"    For further information visit {_PYDANTIC_ERRORS}{kind}"
    )


def _not_a_bool(model: str, value: Any) -> str:
    if isinstance(value, str | int | float):  # a value of a kind it reads, but not a bool's
        message = "Input should be a valid boolean, unable to interpret input"
        return _pydantic(model, "final", message, "bool_parsing", value)
    return _pydantic(model, "final", "Input should be a valid boolean", "bool_type", value)


def _not_a_string(model: str, value: Any, event: dict[str, Any]) -> str:
    if "audio" not in event:
        return _pydantic(model, "audio", "Field required", "missing", event)
    return _pydantic(model, "audio", "Input should be a valid string", "string_type", value)


class RealtimeSession:
    def __init__(self, scope: Scope, receive: Receive, send: Send, config: SimConfig) -> None:
        self.receive, self._send, self.config = receive, send, config
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        self.ttft = number(headers, "x-sim-ttft", float, config.ttft, 0.0)
        self.tps = number(headers, "x-sim-tps", float, config.tokens_per_second, 1e-9)
        self.tokens = number(headers, "x-sim-output-tokens", int, config.output_tokens, 0)
        self.fault = headers.get("x-sim-fault")
        if self.fault is not None and self.fault not in WS_FAULTS:
            raise ControlError(f"x-sim-fault: unknown value {self.fault!r}")
        self.fault_after = number(headers, "x-sim-fault-after", int, 0, 0)
        self.stall = number(headers, "x-sim-stall", float, 1.0, 0.0)
        self.sent: list[str] = []
        self.validated = False
        self.audio = 0
        self.final = asyncio.Event()
        self.generation: asyncio.Task[None] | None = None
        self.closed = False

    async def send(self, event: dict[str, Any] | str) -> None:
        text = event if isinstance(event, str) else orjson.dumps(event).decode()
        self.sent.append(text)
        await self._send({"type": "websocket.send", "text": text})

    async def error(self, message: str, code: str) -> None:
        try:
            message.encode()
        except UnicodeEncodeError as exc:
            # A lone surrogate from the client's event (a "\ud800" escape that json.loads
            # kept) in the answer: pydantic cannot write the error event
            # (PydanticSerializationError), and vLLM's per-event handler answers that
            # instead, as a processing_error (connection.py:76-78); the session goes on.
            message, code = f"Error serializing to JSON: UnicodeEncodeError: {exc}", PROCESSING
        await self.send({"type": "error", "error": message, "code": code})

    async def run(self) -> None:
        if (await self.receive())["type"] != "websocket.connect":
            return
        await self._send({"type": "websocket.accept"})
        created = {"type": "session.created", "id": f"sess-{uuid.uuid4().hex}"}
        await self.send({**created, "created": int(time.time())})
        try:
            while True:
                message = await self.receive()
                if message["type"] == "websocket.disconnect":
                    return
                text = message.get("text")
                if text is None:
                    return  # vLLM's receive_text() fails on a binary frame: the session ends
                try:
                    event = json.loads(text)  # vLLM's reader: NaN and Infinity are JSON
                except json.JSONDecodeError:
                    await self.error("Invalid JSON", "invalid_json")
                    continue
                if not isinstance(event, dict):  # vLLM's `event.get` fails on it
                    await self.error(
                        f"'{type(event).__name__}' object has no attribute 'get'",
                        "processing_error",
                    )
                    continue
                await self.handle(event)
        finally:
            self.closed = True
            if self.generation is not None:
                self.generation.cancel()

    async def handle(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "session.update":
            model = event.get("model")
            if model is None:
                await self.error("Missing required field: model", "invalid_event")
            elif model and model not in self.config.models:  # falsy: any model will do
                await self.error(f"The model `{model}` does not exist.", "model_not_found")
            else:
                self.validated = True
        elif kind == "input_audio_buffer.append":
            audio = event.get("audio")
            if not isinstance(audio, str):
                await self.error(_not_a_string("InputAudioBufferAppend", audio, event), PROCESSING)
                return
            size = pcm16_bytes(audio)
            if size is None:
                await self.error("Invalid audio data", "invalid_audio")
                return
            self.audio += size
        elif kind == "input_audio_buffer.commit":
            final = lax_bool(event.get("final", False))
            if not self.validated:
                await self.error(
                    "Model not validated. Make sure to validate the model by sending a "
                    "session.update event.",
                    "model_not_validated",
                )
            elif final is None:
                await self.error(_not_a_bool("InputAudioBufferCommit", event["final"]), PROCESSING)
            elif final:
                self.final.set()
            elif self.generation is None or self.generation.done():
                self.final = asyncio.Event()
                self.generation = asyncio.create_task(
                    self.generate(asyncio.get_running_loop().time())
                )
        else:
            await self.error(f"Unknown event type: {kind}", "unknown_event")

    async def generate(self, t0: float) -> None:
        loop = asyncio.get_running_loop()
        due = t0 + self.ttft
        pieces: list[str] = []
        for i in range(self.tokens):
            if self.fault is not None and i == self.fault_after and await self.fire():
                return
            while loop.time() < due:  # never early: a timer may fire a little before
                await asyncio.sleep(due - loop.time())
            piece = VOCAB[i % len(VOCAB)]
            pieces.append(piece)
            await self.send({"type": "transcription.delta", "delta": piece})
            due += 1 / self.tps
        if self.fault is not None and self.fault_after >= self.tokens and await self.fire():
            return
        await self.final.wait()
        prompt = 4 + math.ceil(self.audio / BYTES_PER_SECOND * 50)
        self.audio = 0
        usage = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + self.tokens,
            "completion_tokens": self.tokens,
            "prompt_tokens_details": None,
        }
        await self.send({"type": "transcription.done", "text": "".join(pieces), "usage": usage})

    async def fire(self) -> bool:
        """The programmed fault; True when it ends the generation."""
        if self.fault == "error_event":
            await self.error("generation failed", "processing_error")
            return True
        if self.fault == "close_no_done":
            await self._send({"type": "websocket.close", "code": 1011})
            return True
        if self.fault == "malformed":
            await self.send("{not json")
        elif self.fault == "stall":
            await asyncio.sleep(self.stall)
        return False
