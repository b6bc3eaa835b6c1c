"""tests/scrape.py's waits return a scrape that holds the whole of what they waited for.

The pages come from a real server on loopback, in a set order: the first that meets the
condition is torn as tokenprobe's can be (proxy/server/exposition.py renders a family at
a time, letting requests be recorded between families), and the next is whole.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from proxy.types import Receive, Scope, Send
from tests.scrape import Delta, wait_for
from tests.servers import ThreadedServer, serve

BEFORE = "early_total 0\nlate_total 0\n"
TORN = "early_total 0\nlate_total 1\n"  # `early` rendered before the request's record
WHOLE = "early_total 1\nlate_total 1\n"
FALLEN = "early_total 1\nlate_total 0\n"  # `late` a gauge that fell back meanwhile


class Pages:
    """Answers /metrics with each page in turn, then the last one again; anything else
    with "ok"."""

    def __init__(self, *pages: str) -> None:
        self.pages = list(pages)
        self.served = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # lifespan: nothing to start
        page = "ok"
        if scope["path"] == "/metrics":
            page = self.pages[min(self.served, len(self.pages) - 1)]
            self.served += 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": page.encode()})


@pytest.fixture
def pages() -> Iterator[tuple[Pages, ThreadedServer]]:
    app = Pages()
    with serve(app) as server:
        yield app, server


@pytest.mark.parametrize(
    "script",
    [
        pytest.param([BEFORE, TORN, WHOLE], id="the torn scrape is passed over for the next"),
        pytest.param([BEFORE, WHOLE, FALLEN], id="where the next no longer meets it, not"),
    ],
)
def test_a_wait_returns_the_whole_record_it_waited_for(
    pages: tuple[Pages, ThreadedServer], script: list[str]
) -> None:
    app, server = pages
    app.pages = script
    got = wait_for(server.url, "late_total", 1, every=0.01)
    assert (got.total("late_total"), got.total("early_total")) == (1, 1)
    assert app.served == 3  # it looked once more after the page that met the condition


def test_a_delta_reads_the_whole_record_too(pages: tuple[Pages, ThreadedServer]) -> None:
    app, server = pages
    app.pages = [BEFORE, BEFORE, TORN, WHOLE]
    delta = Delta(server.url)  # the first page
    change = delta.when("late_total", 1)
    assert (change("late_total"), change("early_total")) == (1, 1)
