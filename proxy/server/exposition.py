"""/metrics without stalling the streams.

prometheus-client's ASGI app renders the whole exposition in one go on the event loop:
with many label sets, 50 concurrent scrapes raised every stream's per-chunk delay ~6x.
Rendering in a thread is worse: the render holds the GIL and the relay, which gives the
GIL up at every socket call, waits up to a switch interval (5 ms) to get it back, per
call (a convoy). So the render stays on the loop but in slices, and seldom:

- a slice of samples at a time (at most SLICE_SAMPLES), yielding to the loop between
  slices, so a stream waits at most about a millisecond;
- scrapes that arrive while one is rendered share it (one render in flight per format and
  `name[]` set: the only part of the query string that changes the page, so a scraper
  cannot get a render of its own by varying the rest, `?r=<random>`);
- renders run one at a time, and the next starts no sooner than nine times the CPU the
  last one took after it ended (at most a second), whatever its format or names: a
  scrape arriving in that pause waits for it. Rendering thus takes at most ~10% of the
  loop however large the exposition grows, however many scrapers there are and whatever
  they ask. A finished render is never reused: a scrape gets the render in flight when
  it arrived (begun at most one render time earlier) or a later one (a small exposition
  renders in about a millisecond: the pause is then ~10 ms).
"""

from __future__ import annotations

import asyncio
import gzip
import re
from collections.abc import Callable, Iterable
from time import perf_counter
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.metrics_core import Metric

from proxy.types import Receive, Scope, Send

_Key = tuple[str, bool, frozenset[str]]  # content type, gzip, the `name[]` asked (or none)
_MAX_KEYS = 16  # the names are the client's: keep the table small
PACE_FACTOR = 10.0  # wall time per render CPU time, at least
MAX_PAUSE_SECONDS = 1.0
_EOF = b"# EOF\n"
SLICE_SAMPLES = 100  # rendered between two yields to the loop (~1 ms)
# A header (HELP/TYPE/UNIT comment lines) and the sample lines under it.
_SECTION = re.compile(rb"(?P<header>(?:# [^\n]*\n)+)(?P<samples>(?:[^#][^\n]*\n)*)")


class _One:
    """One metric family as a registry, for the encoders (they only call `collect`)."""

    __slots__ = ("family",)

    def __init__(self, family: Metric) -> None:
        self.family = family

    def collect(self) -> Iterable[Metric]:
        return (self.family,)


class _Slices:
    """One large family rendered a slice at a time, joined as if rendered at once.

    The text format writes a family as several sections (the samples, then `_created`
    and the like as gauges of their own), each opened by a HELP/TYPE header: a slice's
    sections are added to those of the slices before it, each header kept once.
    OpenMetrics' `# EOF` is dropped (the exposition adds it once, at its end)."""

    __slots__ = ("openmetrics", "sections")

    def __init__(self, openmetrics: bool) -> None:
        self.openmetrics = openmetrics
        self.sections: dict[bytes, list[bytes]] = {}  # header -> its samples, in order

    def add(self, text: bytes) -> None:
        if self.openmetrics:
            text = text.removesuffix(_EOF)
        for section in _SECTION.finditer(text):
            self.sections.setdefault(section["header"], []).append(section["samples"])

    def text(self) -> bytes:
        return b"".join(header + b"".join(samples) for header, samples in self.sections.items())


class Exposition:
    """An ASGI app serving `registry`; `before` runs first in each render."""

    def __init__(
        self, registry: CollectorRegistry, before: Callable[[], None] | None = None
    ) -> None:
        self.registry = registry
        self.before = before
        self._flights: dict[_Key, asyncio.Task[bytes]] = {}
        self._turn = asyncio.Lock()  # one render at a time, of any key
        self._not_before = 0.0  # when the next render may start

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = scope["headers"]
        accept = b",".join(v for k, v in headers if k == b"accept").decode("latin-1")
        encodings = b",".join(v for k, v in headers if k == b"accept-encoding").decode("latin-1")
        compress = gzip_accepted(encodings)
        content_type = choose_encoder(accept)[1]
        query: bytes = scope.get("query_string", b"")
        names = parse_qs(query.decode("latin-1")).get("name[]") if query else None
        key = (content_type, compress, frozenset(names or ()))
        flight = self._flights.get(key)
        if flight is None:
            if len(self._flights) >= _MAX_KEYS:
                self._flights.clear()  # the tasks run on; they are just not shared
            flight = asyncio.create_task(self._render(key, accept))
            self._flights[key] = flight
            flight.add_done_callback(lambda _: self._flights.pop(key, None))
        body = await asyncio.shield(flight)
        await _respond(send, content_type, body, compress)

    async def _render(self, key: _Key, accept: str) -> bytes:
        async with self._turn:
            pause = self._not_before - perf_counter()
            if pause > 0:
                await asyncio.sleep(pause)  # scrapes arriving meanwhile share this render
            return await self._render_now(key, accept)

    async def _render_now(self, key: _Key, accept: str) -> bytes:
        content_type, compress, names = key
        encoder = choose_encoder(accept)[0]
        busy_since = perf_counter()
        if self.before is not None:
            self.before()
        registry = self.registry.restricted_registry(sorted(names)) if names else self.registry
        openmetrics = content_type.startswith("application/openmetrics-text")
        parts: list[bytes] = []
        busy = 0.0
        for family in registry.collect():
            samples = family.samples
            if len(samples) <= SLICE_SAMPLES:
                text = encoder(_One(family))
                parts.append(text.removesuffix(_EOF) if openmetrics else text)
            else:
                slices = _Slices(openmetrics)
                for start in range(0, len(samples), SLICE_SAMPLES):
                    piece = Metric(family.name, family.documentation, family.type, family.unit)
                    piece.samples = samples[start : start + SLICE_SAMPLES]
                    slices.add(encoder(_One(piece)))
                    busy += perf_counter() - busy_since
                    await asyncio.sleep(0)  # let the streams through between slices
                    busy_since = perf_counter()
                parts.append(slices.text())
            busy += perf_counter() - busy_since
            await asyncio.sleep(0)
            busy_since = perf_counter()
        if openmetrics:
            parts.append(_EOF)
        body = b"".join(parts)
        if compress:
            body = gzip.compress(body, compresslevel=1)
        now = perf_counter()
        busy += now - busy_since
        self._not_before = now + min(busy * (PACE_FACTOR - 1), MAX_PAUSE_SECONDS)
        return body


async def _respond(send: Send, content_type: str, body: bytes, gz: bool) -> None:
    headers = [(b"content-type", content_type.encode()), (b"content-length", b"%d" % len(body))]
    if gz:
        headers.append((b"content-encoding", b"gzip"))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})
