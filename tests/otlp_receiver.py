"""A real OTLP/HTTP trace receiver for tests: POST /v1/traces, protobuf in, spans kept.

    receiver = OtlpReceiver()
    with serve(receiver) as server:
        ... export to server.url ...
        spans = receiver.wait_for(lambda s: len(s) >= 1)

Each received span becomes a `ReceivedSpan` with hex ids, plain attribute values and its
resource's attributes, so tests compare against what a collector would see on the wire.
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

#: OTLP's span kind numbers (trace.proto).
SPAN_KIND_CLIENT = Span.SpanKind.SPAN_KIND_CLIENT
STATUS_CODE_ERROR = 2


@dataclass
class ReceivedEvent:
    name: str
    time_unix_nano: int
    attributes: dict[str, Any]


@dataclass
class ReceivedSpan:
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    trace_state: str
    name: str
    kind: int
    start_time_unix_nano: int
    end_time_unix_nano: int
    attributes: dict[str, Any]
    events: list[ReceivedEvent]
    status_code: int
    status_message: str
    resource: dict[str, Any] = field(default_factory=dict)


def value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(value(item) for item in v.array_value.values)
    if kind == "kvlist_value":
        return attributes(v.kvlist_value.values)
    return None if kind is None else getattr(v, kind)


def attributes(items: Any) -> dict[str, Any]:
    return {kv.key: value(kv.value) for kv in items if isinstance(kv, KeyValue)}


class OtlpReceiver:
    """The ASGI app. Bodies that do not decode get a 400, like a collector's."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._spans: list[ReceivedSpan] = []
        self.requests = 0

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(
        self,
        predicate: Callable[[list[ReceivedSpan]], bool] = bool,
        timeout: float = 10.0,
    ) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout
        with self._lock:
            while not predicate(self._spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"spans received so far: {[s.name for s in self._spans]}")
                self._lock.wait(left)
            return list(self._spans)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        if scope["method"] != "POST" or scope["path"] != "/v1/traces":
            await _respond(send, 404, b"")
            return
        encoding = dict(scope["headers"]).get(b"content-encoding", b"")
        try:
            if encoding == b"gzip":
                body = gzip.decompress(body)
            elif encoding == b"deflate":
                body = zlib.decompress(body)
            request = ExportTraceServiceRequest.FromString(body)
        except Exception:
            await _respond(send, 400, b"")
            return
        self._store(request)
        await _respond(send, 200, ExportTraceServiceResponse().SerializeToString())

    def _store(self, request: ExportTraceServiceRequest) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(_span(span, resource))
        with self._lock:
            self.requests += 1
            self._spans.extend(received)
            self._lock.notify_all()


def _span(span: Span, resource: dict[str, Any]) -> ReceivedSpan:
    return ReceivedSpan(
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_span_id=span.parent_span_id.hex(),
        trace_state=span.trace_state,
        name=span.name,
        kind=span.kind,
        start_time_unix_nano=span.start_time_unix_nano,
        end_time_unix_nano=span.end_time_unix_nano,
        attributes=attributes(span.attributes),
        events=[
            ReceivedEvent(e.name, e.time_unix_nano, attributes(e.attributes)) for e in span.events
        ],
        status_code=span.status.code,
        status_message=span.status.message,
        resource=resource,
    )


async def _respond(send: Any, status: int, body: bytes) -> None:
    headers = [
        (b"content-type", b"application/x-protobuf"),
        (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
