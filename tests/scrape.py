"""A server's Prometheus /metrics as the tests read it: one scrape parsed by
prometheus-client's own parser, a sample summed over the series whose labels include the
ones asked for, and what a block of requests changed.

    scrape(base).total("tokenprobe_generation_tokens_total", source="usage")
    wait_for(base, "tokenprobe_conversation_turns_count", 2)  # a scrape once it is 2 or more

    delta = Delta(base)  # scrapes now
    ... three chat requests ...
    d = delta.after(3, endpoint="/v1/chat/completions")  # once the proxy recorded them
    d("tokenprobe_prompt_tokens_total")  # how much it grew, on that endpoint

Any exposition in the Prometheus text format reads the same: tokenprobe's own, vLLM's,
llama.cpp's. A value is 0 where the server has no such series yet, as a counter that has
not been incremented reads in PromQL's sum().
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.servers import default_trust

__all__ = [
    "REQUESTS",
    "Change",
    "Delta",
    "Sample",
    "Scrape",
    "Series",
    "page",
    "scrape",
    "wait_for",
]

#: The proxy's count of recorded requests: a request is in every other figure once it is here.
REQUESTS = "tokenprobe_requests_total"

WAIT = 30.0  # seconds a test waits for a figure to arrive before its assertions say why not
POLL = 0.05  # seconds between scrapes while it waits

Series = tuple[str, frozenset[tuple[str, str]]]  # a sample's name and its label set


class Scrape:
    """The samples of one exposition. Names and labels are the sample's own, so a counter
    reads as `..._total` and a histogram as `..._bucket`, `..._count` and `..._sum`."""

    def __init__(self, samples: Iterable[Sample]) -> None:
        self.samples = tuple(samples)

    @classmethod
    def parse(cls, text: str) -> Scrape:
        return cls(s for family in text_string_to_metric_families(text) for s in family.samples)

    def series(self, name: str, /, **labels: str) -> list[Sample]:
        """The samples called `name` whose labels include `labels` (and any others)."""
        want = labels.items()
        return [s for s in self.samples if s.name == name and want <= s.labels.items()]

    def total(self, name: str, /, **labels: str) -> float:
        """`name` summed over those series, as PromQL's sum(name{labels}) reads it."""
        return sum((s.value for s in self.series(name, **labels)), 0.0)

    def value(self, name: str, /, **labels: str) -> float:
        """The one series of `name` whose labels are exactly `labels`: a series with more
        labels is another series, not part of this one."""
        return next((s.value for s in self.samples if s.name == name and s.labels == labels), 0.0)

    def totals(self) -> dict[str, float]:
        """Every sample name with its values summed over all its labels."""
        out: dict[str, float] = {}
        for s in self.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
        return out

    def by_series(self) -> dict[Series, float]:
        """Every series' value by its name and label set, for PromQL-like work over two
        scrapes (increase(), sum by). `_created` samples are left out: their value is a
        creation time, not a count, and no increase() is taken of them."""
        return {
            (s.name, frozenset(s.labels.items())): s.value
            for s in self.samples
            if not s.name.endswith("_created")
        }


def scrape(base: str, *, timeout: float = 10.0, headers: Mapping[str, str] | None = None) -> Scrape:
    """`page`, parsed."""
    return Scrape.parse(page(base, timeout=timeout, headers=headers))


def page(base: str, *, timeout: float = 10.0, headers: Mapping[str, str] | None = None) -> str:
    """GET `base`/metrics (plain text, the default exposition); an answer other than 200
    fails here, with its body (not as a parse error of that body)."""
    got = httpx.get(base + "/metrics", timeout=timeout, headers=headers, verify=default_trust())
    assert got.status_code == 200, f"/metrics answered {got.status_code}: {got.text[:500]}"
    return got.text


def wait_for(
    base: str,
    name: str,
    at_least: float,
    /,
    *,
    timeout: float = WAIT,
    every: float = POLL,
    **labels: str,
) -> Scrape:
    """A scrape in which `name{labels}` totals at least `at_least`, whole (`_settled`); the
    last one when `timeout` passes first, so the caller's own assertions say what was
    missing.

    A server records a request just after its response's last byte, and some figures
    later still (an idle conversation, an engine step), so a test that reads at once can
    read too early."""
    return _first(base, lambda now: now.total(name, **labels) >= at_least, timeout, every)


def _first(base: str, enough: Callable[[Scrape], bool], timeout: float, every: float) -> Scrape:
    deadline = time.monotonic() + timeout
    while True:
        now = scrape(base)
        if enough(now):
            return _settled(base, now, enough)
        if time.monotonic() > deadline:
            return now
        time.sleep(every)


def _settled(base: str, met: Scrape, enough: Callable[[Scrape], bool]) -> Scrape:
    """A scrape begun after `met`, the first that met the condition, if it still does
    (a gauge may have fallen back), else `met`.

    tokenprobe renders /metrics a family at a time and lets the event loop run between
    them (proxy/server/exposition.py), so the scrape that first shows a request may have
    rendered the families before the awaited one from before the request was recorded:
    the CI once read a cancelled prompt in tokenprobe_cancelled_prompt_tokens_total and
    not yet in tokenprobe_prompt_tokens_total, rendered earlier. A request is recorded in
    one go, so a scrape begun after `met` holds all of it."""
    again = scrape(base)
    return again if enough(again) else met


@dataclass(frozen=True)
class Change:
    """What changed between two scrapes: `change(name, **labels)` is how much `name`'s
    total grew, each reading narrowed to the change's own `labels` as well."""

    before: Scrape
    after: Scrape
    labels: Mapping[str, str] = field(default_factory=dict)

    def __call__(self, name: str, /, **labels: str) -> float:
        # both label sets as keywords: the same label in each is a TypeError, not an override
        grown = self.after.total(name, **self.labels, **labels)
        return grown - self.before.total(name, **self.labels, **labels)


class Delta:
    """A server's /metrics before a block of requests (scraped when made, unless the
    caller has it already), and the change the block made once the server recorded it."""

    def __init__(self, base: str, before: Scrape | None = None) -> None:
        self.base = base
        self.before = scrape(base) if before is None else before

    def when(self, name: str, grown_by: float, /, **labels: str) -> Change:
        """The change once `name{labels}` grew by `grown_by`, or after WAIT seconds (the
        caller asserts what it needs); each reading of the change narrowed to `labels`."""
        at_least = self.before.total(name, **labels) + grown_by
        after = _first(self.base, lambda now: now.total(name, **labels) >= at_least, WAIT, POLL)
        return Change(self.before, after, labels)

    def after(self, requests: int, /, **labels: str) -> Change:
        """The change once the proxy recorded `requests` more requests matching `labels`,
        failing unless it recorded exactly that many."""
        change = self.when(REQUESTS, requests, **labels)
        done = change(REQUESTS)
        assert done == requests, f"the proxy recorded {done} of {requests} requests"
        return change
