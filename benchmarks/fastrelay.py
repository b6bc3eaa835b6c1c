"""A protocol-level relay for streamed bodies: the design-study arm of issue 15.

Each upstream read is handled inside one callback, `Upstream.data_received`: httptools
(llhttp) frames it, each body piece goes to the client socket at once
(`transport.write`, HTTP/1.1 chunked framing), and the same callback feeds tokenprobe's
own observer (`proxy.core.observe.StreamObserver`) and usage stripper with the time of
the read. There is no task, no `await` and no ASGI message per chunk. Backpressure is the
transports' own: when the client's socket buffer fills, the upstream socket stops being
read (`pause_reading`) until it drains (`resume_reading`).

Per request it does what tokenprobe's relay does: parse the request (`parse_request`),
ask for usage when the client did not (and strip the usage-only event again), begin and
end the request on tokenprobe's `Sinks` with its Prometheus `Metrics`, so the A/B against
`tokenprobe` compares relays doing the same measuring work. Upstream connections are kept
alive and reused. It is a prototype for the benchmark, not a server: no timeouts, no
error bodies, no control plane (those stay on the ASGI side in the proposal).

    python benchmarks/fastrelay.py --port 9002 --upstream-port 9000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
from time import perf_counter, time

import checkout  # noqa: F401  (this checkout's proxy/ first)
import httptools
from prometheus_client import CollectorRegistry

from proxy.core.apis import api_for
from proxy.core.labels import ModelLabels
from proxy.core.measurement import ErrorType
from proxy.core.observe import StreamObserver
from proxy.core.request import RequestInfo, parse_request
from proxy.core.strip import UsageEventStripper
from proxy.sinks.dispatch import RequestScope, Sinks
from proxy.sinks.metrics import Metrics

#: Hop-by-hop headers, and those the relay sets itself.
_DROP_REQUEST = frozenset(
    {b"connection", b"keep-alive", b"te", b"trailer", b"transfer-encoding", b"upgrade"}
    | {b"host", b"content-length", b"accept-encoding", b"proxy-authorization"}
)
_DROP_RESPONSE = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"trailer", b"upgrade"}
    | {b"content-length"}
)
_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 500: b"Internal Server Error"}
_LAST_CHUNK = b"0\r\n\r\n"


class Relay:
    """What every connection shares: the upstream address, the idle upstream pool, the sinks."""

    def __init__(self, upstream: tuple[str, int], inject_usage: bool = True) -> None:
        self.upstream = upstream
        self.host = b"%s:%d" % (upstream[0].encode(), upstream[1])
        self.inject_usage = inject_usage
        self.idle: list[Upstream] = []
        metrics = Metrics(CollectorRegistry())
        self.sinks = Sinks([metrics], metrics=metrics, models=ModelLabels())

    async def connection(self) -> Upstream:
        while self.idle:
            up = self.idle.pop()
            if not up.lost:
                return up
        loop = asyncio.get_running_loop()
        _, up = await loop.create_connection(Upstream, *self.upstream)
        sock = up.transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return up


class FastRelayExchange:
    """One request's measuring state, from the client's request to the response's end."""

    __slots__ = ("info", "observer", "request_scope", "start", "started_at", "stripper")

    def __init__(
        self,
        info: RequestInfo | None,
        request_scope: RequestScope,
        stripper: UsageEventStripper | None,
        start: float,
        started_at: float,
    ) -> None:
        self.info = info
        self.request_scope = request_scope
        self.stripper = stripper
        self.start = start
        self.started_at = started_at
        self.observer = None if info is None else StreamObserver(info, start)


class Upstream(asyncio.Protocol):
    """One keep-alive connection to the backend; relays one response at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.parser = httptools.HttpResponseParser(self)
        self.client: Client | None = None
        self.exchange: FastRelayExchange | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.content_type = b""
        self.status = 0
        self.stripping = False
        self.now = 0.0
        self.lost = False
        self.failed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.client is not None:  # broken mid-response: the client sees the break
            self.client.transport.close()
            self._finish(ErrorType.UPSTREAM_ERROR)

    def start(self, client: Client, exchange: FastRelayExchange, request: bytes) -> None:
        self.client, self.exchange, self.headers, self.failed = client, exchange, [], False
        self.transport.write(request)

    # -- the hot path: one callback per upstream read ---------------------------------------

    def data_received(self, data: bytes) -> None:
        self.now = perf_counter()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.status = self.parser.get_status_code()
        head = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Status"))]
        content_type = b""
        for name, value in self.headers:
            lower = name.lower()
            if lower == b"content-type":
                content_type = value
            if lower not in _DROP_RESPONSE:
                head.append(b"%s: %s\r\n" % (name, value))
        head.append(b"transfer-encoding: chunked\r\n\r\n")
        assert self.client is not None and self.exchange is not None
        self.client.transport.write(b"".join(head))
        exchange = self.exchange
        self.stripping = exchange.stripper is not None and status < 400
        if exchange.observer is not None:
            exchange.observer.open(status, content_type.decode("latin-1"), self.now)

    def on_body(self, body: bytes) -> None:
        exchange = self.exchange
        assert exchange is not None and self.client is not None
        out = exchange.stripper.feed(body) if self.stripping else body  # type: ignore[union-attr]
        if out:
            self.client.transport.write(b"%x\r\n%b\r\n" % (len(out), out))
        observer = exchange.observer
        if observer is not None and not self.failed:
            try:
                observer.feed(body, self.now)
            except Exception:
                self.failed = True
                self.client.relay.sinks.count_measurement_failure("observe")

    def on_message_complete(self) -> None:
        exchange, client = self.exchange, self.client
        assert exchange is not None and client is not None
        if self.stripping and (rest := exchange.stripper.flush()):  # type: ignore[union-attr]
            client.transport.write(b"%x\r\n%b\r\n" % (len(rest), rest))
        client.transport.write(_LAST_CHUNK)
        if exchange.observer is not None and not self.failed:
            with contextlib.suppress(Exception):
                exchange.observer.end_of_stream(self.now)
        self._finish(None)
        if self.parser.should_keep_alive():
            client.relay.idle.append(self)
        else:
            self.transport.close()
        client.done()

    def _finish(self, broke: ErrorType | None) -> None:
        exchange, client = self.exchange, self.client
        self.exchange = self.client = None
        if exchange is None or client is None:
            return
        sinks = client.relay.sinks
        observer = exchange.observer
        if observer is None or self.failed:
            sinks.end(exchange.request_scope, None)
            return
        # The relay's own finish sequence; it awaits only a tokenizer, which this arm has not.
        finishing = asyncio.ensure_future(
            observer.finish(
                end=perf_counter(),
                started_at=exchange.started_at,
                status_code=self.status,
                error_type=broke,
                error_message="upstream broke" if broke else None,
            )
        )
        finishing.add_done_callback(lambda done: sinks.end(exchange.request_scope, done.result()))

    # -- backpressure: the client's socket is full ------------------------------------------

    def pause(self) -> None:
        self.transport.pause_reading()

    def resume(self) -> None:
        self.transport.resume_reading()


class Client(asyncio.Protocol):
    """One client connection: read a request, relay it, relay its response, repeat."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.headers: list[bytes] = []
        self.body: list[bytes] = []
        self.up: Upstream | None = None
        self.waiting: list[bytes] = []  # a pipelined next request, until this one ends

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        up, self.up = self.up, None
        if up is not None and up.client is self:  # the client went away: abort upstream
            up._finish(ErrorType.CLIENT_CANCELLED)
            up.transport.close()

    def pause_writing(self) -> None:
        if self.up is not None:
            self.up.pause()

    def resume_writing(self) -> None:
        if self.up is not None:
            self.up.resume()

    def data_received(self, data: bytes) -> None:
        if self.up is not None:
            self.waiting.append(data)
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
            self.transport.close()

    def on_message_begin(self) -> None:
        self.url, self.headers, self.body = b"", [], []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() not in _DROP_REQUEST:
            self.headers.append(b"%s: %s\r\n" % (name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        start, started_at = perf_counter(), time()
        body = b"".join(self.body)
        method = self.parser.get_method()
        path = self.url.split(b"?", 1)[0].decode("latin-1")
        info: RequestInfo | None = None
        stripper = None
        api = api_for(path) if method == b"POST" else None
        if api is not None:
            info, obj = parse_request(api, body)
            if self.relay.inject_usage and info.stream and not info.usage_requested and obj:
                asked = api.ask_for_usage(obj)
                if asked is not None:
                    body, stripper = asked, UsageEventStripper()
        request_scope = self.relay.sinks.begin(info, [], started_at)
        exchange = FastRelayExchange(info, request_scope, stripper, start, started_at)
        request = b"".join(
            [
                b"%s %s HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n"
                % (method, self.url, self.relay.host, len(body)),
                *self.headers,
                b"\r\n",
                body,
            ]
        )
        self.transport.pause_reading()  # one request at a time on this connection
        asyncio.get_running_loop().create_task(self._send(exchange, request))

    async def _send(self, exchange: FastRelayExchange, request: bytes) -> None:
        try:
            up = await self.relay.connection()
        except OSError:
            self.relay.sinks.end(exchange.request_scope, None)
            self.transport.write(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n")
            self.transport.close()
            return
        if self.transport.is_closing():
            self.relay.idle.append(up)
            self.relay.sinks.end(exchange.request_scope, None)
            return
        self.up = up
        up.start(self, exchange, request)

    def done(self) -> None:
        """The response ended: read the next request on this connection."""
        self.up = None
        if self.transport.is_closing():
            return
        self.transport.resume_reading()
        waiting, self.waiting = b"".join(self.waiting), []
        if waiting:
            self.data_received(waiting)


async def serve(port: int, upstream: tuple[str, int], reuse_port: bool = False) -> None:
    relay = Relay(upstream)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: Client(relay), "127.0.0.1", port, backlog=4096, reuse_port=reuse_port
    )
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream-port", type=int, required=True)
    parser.add_argument("--upstream-host", default="127.0.0.1")
    parser.add_argument("--reuse-port", action="store_true", help="share the port (N processes)")
    args = parser.parse_args()
    import uvloop

    uvloop.run(serve(args.port, (args.upstream_host, args.upstream_port), args.reuse_port))


if __name__ == "__main__":
    main()
