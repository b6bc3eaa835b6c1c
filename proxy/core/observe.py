"""Watches the bytes of one response on the side and turns them into a Measurement.

The relay calls `feed(chunk, now)` after each chunk has gone to the client, with `now` the
time of that network read, so this module never reads a clock and tests can replay
recorded streams with synthetic timestamps. Only a few facts are taken from each event:
whether it carries generated content, finish_reason, usage, an in-stream error, and the
response id/model. Non-streaming bodies are kept (bounded) and parsed once at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from proxy.core.errors import classify_response, error_message
from proxy.core.measurement import NONE_LABEL, ErrorType, Measurement, TokenSource
from proxy.core.request import CHAT, RequestInfo
from proxy.core.sse import DEFAULT_MAX_EVENT_BYTES, SSEDecoder

#: The most of a non-streaming or error body kept for parsing. Bigger bodies are still
#: relayed in full; they are only measured from what fits.
MAX_KEPT_BODY = 8 * 1024 * 1024


@dataclass(slots=True)
class TokenCounts:
    prompt: int | None
    output: int | None
    cached: int | None
    source: TokenSource


class StreamObserver:
    """One per measured request. Not thread-safe; lives on the event loop."""

    def __init__(
        self,
        request: RequestInfo,
        start: float,
        collect_text: bool = False,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
    ) -> None:
        self.request = request
        self.start = start
        self._chat = request.endpoint == CHAT
        self._collect = collect_text
        self.status = 0
        self.streaming = False
        self.first_byte: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.itl: list[float] = []
        self.content_events = 0
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.stream_error: object = None
        self.done = False
        self.malformed_events = 0
        self.response_id: str | None = None
        self.response_model: str | None = None
        self.texts: list[str] = []
        self._decoder = SSEDecoder(max_event_bytes)
        self._body: list[bytes] = []
        self._kept = 0

    # -- the relay's side -------------------------------------------------------------

    def open(self, status: int, content_type: str, now: float) -> None:
        """Upstream response headers arrived."""
        self.status = status
        self.first_byte = now
        self.streaming = status < 400 and content_type.startswith("text/event-stream")

    def feed(self, chunk: bytes, now: float) -> None:
        """A chunk that was just relayed to the client, read from the network at `now`."""
        if self.streaming:
            for payload in self._decoder.feed(chunk):
                self._event(payload, now)
        elif self._kept < MAX_KEPT_BODY:
            self._body.append(chunk)
            self._kept += len(chunk)

    def end_of_stream(self, now: float) -> None:
        """The upstream body ended cleanly: dispatch a final event that lacked its blank line."""
        if self.streaming:
            for payload in self._decoder.flush():
                self._event(payload, now)

    # -- event parsing ----------------------------------------------------------------

    def _event(self, payload: bytes, now: float) -> None:
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self.malformed_events += 1
            return
        if type(obj) is not dict:
            self.malformed_events += 1
            return
        if self.response_id is None:
            self._identify(obj)
        choices = obj.get("choices")
        if choices and type(choices) is list and self._choices(choices):
            self.content_events += 1
            if self.first_token is None:
                self.first_token = now
            else:
                self.itl.append(now - self.last_token)  # type: ignore[operator]
            self.last_token = now
        usage = obj.get("usage")
        if usage and type(usage) is dict:
            self.usage = usage
        error = obj.get("error")
        if error is not None:
            self.stream_error = error

    def _choices(self, choices: list[Any]) -> bool:
        """Note finish_reason; True when any choice carries generated content."""
        content = False
        for choice in choices:
            if type(choice) is not dict:
                continue
            if self._chat:
                delta = choice.get("delta")
                if delta and type(delta) is dict:
                    for key in ("content", "reasoning_content", "reasoning", "tool_calls"):
                        value = delta.get(key)
                        if value:
                            content = True
                            if self._collect:
                                self._keep_text(value)
            else:
                text = choice.get("text")
                if text:
                    content = True
                    if self._collect:
                        self._keep_text(text)
            reason = choice.get("finish_reason")
            if reason and type(reason) is str:
                self.finish_reason = reason
        return content

    def _keep_text(self, value: object) -> None:
        if type(value) is str:
            self.texts.append(value)
        elif type(value) is list:  # tool_calls: count the function names and arguments
            for call in value:
                function = call.get("function") if type(call) is dict else None
                if type(function) is dict:
                    self.texts.extend(
                        v
                        for v in (function.get("name"), function.get("arguments"))
                        if type(v) is str
                    )

    def _identify(self, obj: dict[str, Any]) -> None:
        rid, model = obj.get("id"), obj.get("model")
        self.response_id = rid if type(rid) is str else ""
        self.response_model = model if type(model) is str else None

    # -- the end ----------------------------------------------------------------------

    def body(self) -> bytes:
        return b"".join(self._body)

    def outcome(self) -> tuple[ErrorType | None, str | None]:
        """The error type (None for success) judged from what was seen, for a response that
        reached its end without a transport failure."""
        if self.status >= 400:
            body = self.body()
            return classify_response(self.status, body), error_message(body)
        if self.streaming:
            if self.stream_error is not None:
                return ErrorType.STREAM_ERROR, _stream_error_message(self.stream_error)
            if not self.done and self.finish_reason is None:
                return ErrorType.STREAM_TRUNCATED, "stream ended without [DONE] or finish_reason"
            return None, None
        self._parse_body()
        return None, None

    def _parse_body(self) -> None:
        """A non-streaming success: take usage, finish_reason and identity from the JSON."""
        try:
            obj = orjson.loads(self.body())
        except orjson.JSONDecodeError:
            self.malformed_events += 1
            return
        if type(obj) is not dict:
            return
        self._identify(obj)
        choices = obj.get("choices")
        if type(choices) is list:
            for choice in choices:
                if type(choice) is not dict:
                    continue
                reason = choice.get("finish_reason")
                if reason and type(reason) is str:
                    self.finish_reason = reason
                if self._collect:
                    message = choice.get("message")
                    text = message.get("content") if type(message) is dict else choice.get("text")
                    if type(text) is str:
                        self.texts.append(text)
        usage = obj.get("usage")
        if type(usage) is dict:
            self.usage = usage

    def counts_from_usage(self) -> TokenCounts | None:
        usage = self.usage
        if not usage or type(usage.get("completion_tokens")) is not int:
            return None
        prompt = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if type(details) is dict else None
        return TokenCounts(
            prompt=prompt if type(prompt) is int else None,
            output=usage["completion_tokens"],
            cached=cached if type(cached) is int else None,
            source=TokenSource.USAGE,
        )

    def counts_from_chunks(self) -> TokenCounts:
        if not self.streaming:
            return TokenCounts(None, None, None, TokenSource.NONE)
        return TokenCounts(None, self.content_events, None, TokenSource.CHUNKS)

    def measurement(
        self,
        *,
        end: float,
        started_at: float,
        status_code: int,
        counts: TokenCounts,
        error_type: ErrorType | None,
        error_message: str | None,
        trace_id: str | None = None,
    ) -> Measurement:
        output = counts.output
        first, last = self.first_token, self.last_token
        tpot = tps = None
        if output is not None and output >= 2 and first is not None and last is not None:
            span = last - first
            tpot = span / (output - 1)
            tps = (output - 1) / span if span > 0 else None
        request = self.request
        return Measurement(
            endpoint=request.endpoint,
            model=request.model,
            stream=self.streaming,
            status_code=status_code,
            started_at=started_at,
            ttfb=None if self.first_byte is None else self.first_byte - self.start,
            ttft=None if first is None else first - self.start,
            tpot=tpot,
            decode_tokens_per_second=tps,
            e2e=end - self.start,
            inter_token_latencies=tuple(self.itl),
            prompt_tokens=counts.prompt,
            output_tokens=output,
            cached_prompt_tokens=counts.cached,
            token_source=counts.source,
            content_events=self.content_events,
            finish_reason=self.finish_reason or NONE_LABEL,
            error_type=error_type,
            error_message=error_message,
            response_id=self.response_id or None,
            response_model=self.response_model,
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            trace_id=trace_id,
        )


def _stream_error_message(error: object) -> str:
    return error_message(orjson.dumps(error if isinstance(error, dict) else {"error": error}))
