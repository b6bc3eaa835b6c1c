"""/metrics without stalling the streams.

prometheus-client's ASGI app renders the exposition on the event loop: with many label
sets, 50 concurrent scrapes raised every stream's per-chunk delay ~6x. Here the rendering
runs in a worker thread, and scrapes that arrive while one is being rendered share it
(one render in flight per format at any time), so the loop's cost stays a few sends per
scrape however large the exposition grows. A scrape never gets values older than the
render in flight when it arrived.
"""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import Callable
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder, gzip_accepted

from proxy.types import Receive, Scope, Send

_Key = tuple[str, bool, bytes]  # content type, gzip, query string
_MAX_FLIGHTS = 16  # query strings are the client's: keep the table small


class Exposition:
    """An ASGI app serving `registry`; `before` runs first in each render (in the thread)."""

    def __init__(
        self, registry: CollectorRegistry, before: Callable[[], None] | None = None
    ) -> None:
        self.registry = registry
        self.before = before
        self._flights: dict[_Key, asyncio.Future[bytes]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = scope["headers"]
        accept = b",".join(v for k, v in headers if k == b"accept").decode("latin-1")
        encodings = b",".join(v for k, v in headers if k == b"accept-encoding").decode("latin-1")
        encoder, content_type = choose_encoder(accept)
        compress = gzip_accepted(encodings)
        query: bytes = scope.get("query_string", b"")
        key = (content_type, compress, query)
        flight = self._flights.get(key)
        if flight is None:
            if len(self._flights) >= _MAX_FLIGHTS:
                await self._respond(
                    send, 429, b"text/plain", b"too many concurrent scrapes\n", False
                )
                return
            names = parse_qs(query.decode("latin-1")).get("name[]")

            def render() -> bytes:
                if self.before is not None:
                    self.before()
                registry = self.registry.restricted_registry(names) if names else self.registry
                output = encoder(registry)
                return gzip.compress(output, compresslevel=1) if compress else output

            flight = asyncio.ensure_future(asyncio.to_thread(render))
            self._flights[key] = flight
            flight.add_done_callback(lambda _: self._flights.pop(key, None))
        body = await asyncio.shield(flight)
        await self._respond(send, 200, content_type.encode(), body, compress)

    @staticmethod
    async def _respond(send: Send, status: int, content_type: bytes, body: bytes, gz: bool) -> None:
        headers = [(b"content-type", content_type), (b"content-length", b"%d" % len(body))]
        if gz:
            headers.append((b"content-encoding", b"gzip"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
