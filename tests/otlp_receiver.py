"""Real OTLP receivers for tests: OTLP/HTTP (POST /v1/traces, /v1/metrics) and OTLP/gRPC
metrics, protobuf in, what arrived kept.

    receiver = OtlpReceiver()
    with serve(receiver) as server:
        ... export to server.url ...
        spans = receiver.wait_for(lambda s: len(s) >= 1)
        exports = receiver.metrics.wait_for(lambda m: ...)

Each received span becomes a `ReceivedSpan` with hex ids, plain attribute values and its
resource's attributes, so tests compare against what a collector would see on the wire.
Metric exports are kept whole (`ExportMetricsServiceRequest`, with their raw bytes), and
`points` flattens them.
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
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


@dataclass
class ReceivedPoint:
    """One data point of one metric in one export, flattened."""

    metric: str
    unit: str
    kind: str  # histogram or sum
    attributes: dict[str, Any]
    resource: dict[str, Any]
    temporality: int  # 1 delta, 2 cumulative (AggregationTemporality in metrics.proto)
    count: int = 0  # histograms
    sum: float = 0.0  # histograms: the sum; sums: the value
    bucket_counts: tuple[int, ...] = ()
    explicit_bounds: tuple[float, ...] = ()
    monotonic: bool = False


def points(request: ExportMetricsServiceRequest) -> list[ReceivedPoint]:
    found = []
    for rm in request.resource_metrics:
        resource = attributes(rm.resource.attributes)
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                kind = metric.WhichOneof("data")
                if kind == "histogram":
                    for p in metric.histogram.data_points:
                        found.append(
                            ReceivedPoint(
                                metric.name,
                                metric.unit,
                                kind,
                                attributes(p.attributes),
                                resource,
                                metric.histogram.aggregation_temporality,
                                count=p.count,
                                sum=p.sum,
                                bucket_counts=tuple(p.bucket_counts),
                                explicit_bounds=tuple(p.explicit_bounds),
                            )
                        )
                elif kind == "sum":
                    for n in metric.sum.data_points:
                        value = n.as_double if n.WhichOneof("value") == "as_double" else n.as_int
                        found.append(
                            ReceivedPoint(
                                metric.name,
                                metric.unit,
                                kind,
                                attributes(n.attributes),
                                resource,
                                metric.sum.aggregation_temporality,
                                sum=value,
                                monotonic=metric.sum.is_monotonic,
                            )
                        )
    return found


class MetricExports:
    """Metric export requests as they arrived, for the HTTP and gRPC receivers alike."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._requests: list[ExportMetricsServiceRequest] = []
        self.raw: list[bytes] = []

    def add(self, body: bytes) -> None:
        request = ExportMetricsServiceRequest.FromString(body)
        with self._lock:
            self._requests.append(request)
            self.raw.append(body)
            self._lock.notify_all()

    @property
    def requests(self) -> list[ExportMetricsServiceRequest]:
        with self._lock:
            return list(self._requests)

    def wait_for(
        self,
        predicate: Callable[[list[ExportMetricsServiceRequest]], bool],
        timeout: float = 20.0,
    ) -> list[ExportMetricsServiceRequest]:
        deadline = time.monotonic() + timeout
        with self._lock:
            while not predicate(self._requests):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(self._requests)} metric exports received so far")
                self._lock.wait(left)
            return list(self._requests)


class OtlpReceiver:
    """The ASGI app. Bodies that do not decode get a 400, like a collector's."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._spans: list[ReceivedSpan] = []
        self.requests = 0
        self.metrics = MetricExports()

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
        if scope["method"] != "POST" or scope["path"] not in ("/v1/traces", "/v1/metrics"):
            await _respond(send, 404, b"")
            return
        encoding = dict(scope["headers"]).get(b"content-encoding", b"")
        try:
            if encoding == b"gzip":
                body = gzip.decompress(body)
            elif encoding == b"deflate":
                body = zlib.decompress(body)
            if scope["path"] == "/v1/metrics":
                self.metrics.add(body)
                answer = ExportMetricsServiceResponse().SerializeToString()
            else:
                self._store(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
        except Exception:
            await _respond(send, 400, b"")
            return
        await _respond(send, 200, answer)

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


class GrpcMetricsReceiver:
    """An OTLP/gRPC metrics receiver on an ephemeral 127.0.0.1 port (grpcio's server).

    with GrpcMetricsReceiver() as receiver: ... export to receiver.url ...
    """

    def __init__(self) -> None:
        self.metrics = MetricExports()
        self.url = ""

    def __enter__(self) -> GrpcMetricsReceiver:
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc

        exports = self.metrics

        class Service(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request: Any, context: Any) -> ExportMetricsServiceResponse:
                exports.add(request.SerializeToString())
                return ExportMetricsServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Service(), self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None)
