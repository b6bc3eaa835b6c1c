"""The live view (/ui): served where /metrics is, small, and right in a real browser.

The browser tests drive Debian's `chromium` through Playwright (`executable_path`, no
browser download) against the proxy in front of the simulator. They compare what the
page shows with a PromQL-style evaluation of the same two scrapes, done here in Python
with prometheus-client's own text parser and an independent histogram_quantile.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.ui import ASSETS
from tests.conftest import MODEL, ProxyUnderTest, Running
from tests.paths import ROOT
from tests.scrape import REQUESTS, Scrape, Series
from tests.server.conftest import no_proxy, paths
from tests.servers import free_port
from tests.wheels import pure_wheel

CHAT = "/v1/chat/completions"
CHROMIUM = os.environ.get("TOKENPROBE_TEST_CHROMIUM") or shutil.which("chromium")
SERVE = (sys.executable, "-m", "proxy", "serve", "--access-log", "off", "--model-allowlist", MODEL)


def _chat(max_tokens: int = 32) -> dict[str, Any]:
    return {
        "model": MODEL,
        "stream": True,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "hi"}],
    }


# -- no browser needed -----------------------------------------------------------------


@no_proxy
def test_page_weight_html_js_css_is_under_250_kb() -> None:
    weight = sum(
        len(body)
        for name, (kind, body) in ASSETS.items()
        if kind.split(b";")[0] in (b"text/html", b"text/javascript", b"text/css")
    )
    assert {"", "app.js", "prom.js", "ui.css", "uPlot.iife.min.js", "uPlot.LICENSE"} <= set(ASSETS)
    assert 50_000 < weight < 250_000, weight


def test_ui_is_served_on_the_proxy_port_with_a_same_origin_only_policy(
    proxy: ProxyUnderTest,
) -> None:
    page = httpx.get(proxy.url + "/ui")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    for src in ('src="ui/app.js"', 'src="ui/prom.js"', 'src="ui/uPlot.iife.min.js"'):
        assert src in page.text
    assert "http" not in page.text.replace("https://github.com", "")  # nothing off-origin
    script = httpx.get(proxy.url + "/ui/app.js")
    assert script.headers["content-type"].startswith("text/javascript")
    assert script.content == ASSETS["app.js"][1]
    assert httpx.get(proxy.url + "/ui/../settings.py").status_code == 404
    assert httpx.get(proxy.url + "/ui/nothing.js").status_code == 404
    slash = httpx.get(proxy.url + "/ui/")
    assert (slash.status_code, slash.headers["location"]) == (308, "/ui")
    assert httpx.post(proxy.url + "/ui").status_code == 405


def test_ui_moves_with_metrics_to_the_metrics_port(
    sim: Running, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    port = free_port()
    proxy = start_proxy(sim.url, metrics_port=port)
    assert httpx.get(f"http://127.0.0.1:{port}/ui").status_code == 200
    assert httpx.get(f"http://127.0.0.1:{port}/ui/prom.js").status_code == 200
    assert httpx.get(proxy.url + "/ui").status_code == 404


@no_proxy
def test_a_built_wheel_ships_the_ui_assets(tmp_path_factory: pytest.TempPathFactory) -> None:
    """`pip install .` (not editable) must carry proxy/ui/static/*: package data.

    The wheel tests/test_build.py builds where nothing is compiled (tests/wheels.py), from a
    copy of the sources, so the worktree gets no build/ or egg-info."""
    pytest.importorskip("wheel", reason="pip install wheel (setuptools builds wheels with it)")
    built = pure_wheel(tmp_path_factory)
    assert built.returncode == 0, built.output[-6000:]
    (wheel,) = built.wheels()
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"proxy/ui/static/{p.name}" for p in (ROOT / "proxy/ui/static").iterdir()}
    assert shipped <= names, shipped - names


# -- PromQL over two scrapes, in Python --------------------------------------------------


def _series(before: str, now: str) -> tuple[dict[Series, float], dict[Series, float]]:
    """Both scrapes' series by name and labels (their `_created` samples left out)."""
    return Scrape.parse(before).by_series(), Scrape.parse(now).by_series()


def _increase(before: float | None, now: float) -> float:
    """increase() between two samples; a series absent before counts from 0, a drop is a reset."""
    if before is None:
        return now
    return now - before if now >= before else now


def histogram_quantile(q: float, buckets: dict[float, float]) -> float:
    """PromQL's classic-histogram quantile (prometheus/prometheus promql/quantile.go)."""
    ordered = sorted(buckets.items())
    if len(ordered) < 2 or ordered[-1][0] != math.inf:
        return math.nan
    counts = [c for _, c in ordered]
    for i in range(1, len(counts)):
        counts[i] = max(counts[i], counts[i - 1])
    total = counts[-1]
    if total == 0:
        return math.nan
    rank = q * total
    b = next((i for i in range(len(counts) - 1) if counts[i] >= rank), len(counts) - 1)
    if b == len(counts) - 1:
        return ordered[-2][0]
    if b == 0 and ordered[0][0] <= 0:
        return ordered[0][0]
    start, count = 0.0, counts[b]
    if b > 0:
        start = ordered[b - 1][0]
        count -= counts[b - 1]
        rank -= counts[b - 1]
    return start + (ordered[b][0] - start) * (rank / count)


def promql_window(before: str, now: str) -> tuple[dict[str, float], dict[float, float]]:
    """sum by (error_type) (increase(requests_total)) and sum by (le) (increase(ttft_bucket))."""
    old, new = _series(before, now)
    outcomes: dict[str, float] = {}
    ttft: dict[float, float] = {}
    for (name, labels), value in new.items():
        delta = _increase(old.get((name, labels)), value)
        tags = dict(labels)
        if name == "tokenprobe_requests_total":
            outcome = "success" if tags["error_type"] == "none" else tags["error_type"]
            outcomes[outcome] = outcomes.get(outcome, 0.0) + delta
        elif name == "tokenprobe_time_to_first_token_seconds_bucket":
            le = float(tags["le"])
            ttft[le] = ttft.get(le, 0.0) + delta
    return {k: v for k, v in outcomes.items() if v > 0}, ttft


@no_proxy
def test_python_histogram_quantile_interpolates_like_promql() -> None:
    # 10 observations: 4 in (0, 0.1], 6 in (0.1, 0.5]; the median is rank 5, 1 of 6 into
    # the second bucket; the 0.99 quantile falls in +Inf and reads the highest finite bound.
    buckets = {0.1: 4.0, 0.5: 10.0, math.inf: 10.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (1 / 6))
    assert histogram_quantile(0.2, buckets) == pytest.approx(0.05)
    assert histogram_quantile(0.99, {0.1: 4.0, 0.5: 9.0, math.inf: 10.0}) == 0.5
    assert math.isnan(histogram_quantile(0.5, {0.1: 0.0, math.inf: 0.0}))


# -- in a real browser -------------------------------------------------------------------


class Page:
    """A Playwright page that records console errors and every URL it asks for."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.errors: list[str] = []
        self.urls: list[str] = []
        page.on("pageerror", lambda exc: self.errors.append(f"page error: {exc}"))
        page.on(
            "console",
            lambda msg: self.errors.append(msg.text) if msg.type in ("error", "warning") else None,
        )
        page.on("request", lambda request: self.urls.append(request.url))

    def scrapes(self) -> int:
        return int(self.page.get_attribute("body", "data-scrapes") or 0)

    def wait_for_scrapes(self, at_least: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while self.scrapes() < at_least:
            assert time.monotonic() < deadline, f"the page made {self.scrapes()} scrapes"
            self.page.wait_for_timeout(50)

    def outcomes(self) -> dict[str, float]:
        return {
            row.get_attribute("data-outcome"): float(row.get_attribute("data-count"))
            for row in self.page.query_selector_all("#outcomes tbody tr[data-outcome]")
        }

    def stat(self, name: str) -> float:
        return float(self.page.get_attribute(f'[data-stat="{name}"]', "data-value"))


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if CHROMIUM is None:
        why = "chromium not found (Debian: apt-get install chromium)"
        if os.environ.get("CI") == "true":  # as tests/prom.py: CI must not skip silently
            pytest.fail(f"{why}; CI must install it")
        pytest.skip(why)
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield launched
        launched.close()


@pytest.fixture
def open_page(browser: Any) -> Iterator[Callable[[str], Page]]:
    contexts: list[Any] = []

    def open_(url: str) -> Page:
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        contexts.append(context)
        page = Page(context.new_page())
        page.page.goto(url)
        return page

    yield open_
    for context in contexts:
        context.close()


def _traffic(client: httpx.Client) -> int:
    """Successes at seven first-token delays, two answers cut off, four errors; the count."""
    sent = 0
    for ttft in ("0.02", "0.03", "0.05", "0.07", "0.09", "0.15", "0.3"):
        client.post(CHAT, json=_chat(), headers={"x-sim-ttft": ttft, "x-sim-output-tokens": "4"})
        sent += 1
    for _ in range(2):
        client.post(CHAT, json=_chat(max_tokens=3), headers={"x-sim-output-tokens": "20"})
        sent += 1
    for kind in ("auth", "auth", "rate_limit", "token_exchange"):
        client.post(CHAT, json=_chat(), headers={"x-sim-error": kind})
        sent += 1
    client.post(CHAT, json=_chat(max_tokens=1_000_000))  # context_length
    return sent + 1


def metrics_after(client: httpx.Client, requests: int) -> str:
    """/metrics once it counts `requests` requests, from a render begun after the first
    that did: every family whole (tests/scrape.py, `_settled`).

    A GET sent once the last request was recorded is not enough: a scrape that arrives
    while another is rendered shares that render (proxy/server/exposition.py), begun
    before the record perhaps, and the page polls every 300 ms. The CI once read the
    second batch without its last request (context_length) so. Renders run one at a
    time: the one after the first that counted them all began after the last record."""
    deadline = time.monotonic() + 10
    while (counted := Scrape.parse(client.get("/metrics").text).total(REQUESTS)) < requests:
        assert time.monotonic() < deadline, f"/metrics counts {counted:g} of {requests} requests"
        time.sleep(0.02)
    return client.get("/metrics").text


def test_page_numbers_match_promql_over_the_same_scrapes(
    proxy: ProxyUnderTest, open_page: Callable[[str], Page], tmp_path: Path
) -> None:
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        done = _traffic(client)  # before the page opens: its window must subtract these
        proxy.wait_records(done, timeout=10)
        before = metrics_after(client, done)
        page = open_page(proxy.url + "/ui?interval=300")
        page.wait_for_scrapes(2)  # the window's oldest scrape is `before`'s state
        done += _traffic(client)
        proxy.wait_records(done, timeout=10)
        now = metrics_after(client, done)
        seen = page.scrapes()
        page.wait_for_scrapes(seen + 2)  # one whole poll after `now` was taken

    outcomes, ttft = promql_window(before, now)
    assert set(outcomes) == {"success", "auth", "rate_limit", "context_length"}
    assert page.outcomes() == outcomes
    expected_p50 = histogram_quantile(0.5, ttft)
    assert 0.02 < expected_p50 < 0.3
    assert page.stat("ttft_p50") / 1000 == pytest.approx(expected_p50, rel=1e-9)
    assert page.stat("cut_off") == pytest.approx(100 * 2 / 14)
    assert page.stat("in_flight") == 0

    assert page.errors == []
    assert {u.split("/", 3)[2] for u in page.urls} == {proxy.url.split("/", 3)[2]}
    for chart in ("ttft", "itl", "speed", "throughput", "requests", "cutoff", "inflight"):
        assert page.page.query_selector(f"#chart-{chart} canvas") is not None, chart
    shot = tmp_path / "ui.png"
    page.page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000


def _buckets(before: str, now: str, histogram: str) -> dict[float, float]:
    """sum by (le) (increase(<histogram>_bucket)) between two scrapes."""
    old, new = _series(before, now)
    out: dict[float, float] = {}
    for (name, labels), value in new.items():
        if name == histogram + "_bucket":
            le = float(dict(labels)["le"])
            out[le] = out.get(le, 0.0) + _increase(old.get((name, labels)), value)
    return out


def test_page_shows_the_first_answer_after_the_first_token(
    proxy: ProxyUnderTest, open_page: Callable[[str], Page]
) -> None:
    """Reasoning streams (issue 26): the first answer comes 20 reasoning tokens after the
    first token, and the page's first-answer p50 is PromQL's over the same scrapes."""
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        before = client.get("/metrics").text
        page = open_page(proxy.url + "/ui?interval=300")
        page.wait_for_scrapes(2)
        program = {"x-sim-ttft": "0.02", "x-sim-tps": "400", "x-sim-output-tokens": "3",
                   "x-sim-reasoning-tokens": "20"}  # fmt: skip
        for _ in range(4):
            client.post(CHAT, json=_chat(), headers=program)
        proxy.wait_records(4, timeout=10)
        # The scrape the test reads holds all four first tokens: one read while the last
        # was still on its way to the histograms (the CI once read three there, the page
        # four) compares two different windows.
        deadline = time.monotonic() + 10
        while True:
            now = client.get("/metrics").text
            counted = [
                _buckets(before, now, name).get(math.inf, 0.0)
                for name in (
                    "tokenprobe_time_to_first_token_seconds",
                    "tokenprobe_time_to_first_answer_token_seconds",
                )
            ]
            if counted == [4, 4] or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert counted == [4, 4], counted
        seen = page.scrapes()
        page.wait_for_scrapes(seen + 2)
    first_answer = histogram_quantile(
        0.5, _buckets(before, now, "tokenprobe_time_to_first_answer_token_seconds")
    )
    first_token = histogram_quantile(
        0.5, _buckets(before, now, "tokenprobe_time_to_first_token_seconds")
    )
    assert first_answer > first_token
    assert page.stat("ttfa_p50") / 1000 == pytest.approx(first_answer, rel=1e-9)
    assert page.stat("ttft_p50") / 1000 == pytest.approx(first_token, rel=1e-9)
    assert page.errors == []


def _split(before: str, now: str) -> dict[str, float]:
    """Seconds of each part of the first token's time over the window, as PromQL's
    sum(increase(...)) of the three _sum series would give them (streams only)."""
    old, new = _series(before, now)
    parts = {
        "tokenprobe_engine_queue_time_seconds_sum": "queue",
        "tokenprobe_engine_time_to_first_token_seconds_sum": "engine",
        "tokenprobe_time_to_first_token_outside_engine_seconds_sum": "outside",
    }
    out = dict.fromkeys(parts.values(), 0.0)
    for (name, labels), value in new.items():
        if name in parts and dict(labels).get("stream", "true") == "true":
            out[parts[name]] += _increase(old.get((name, labels)), value)
    return out


def test_page_shows_where_the_first_tokens_time_goes(
    start_sim: Callable[..., Running],
    start_proxy: Callable[..., ProxyUnderTest],
    open_page: Callable[[str], Page],
) -> None:
    sim = start_sim(
        ttft=0.05,
        tokens_per_second=200.0,
        output_tokens=40,
        per_request_metrics=True,
        max_num_seqs=1,
    )
    proxy = start_proxy(sim.url)

    def burst(client: httpx.Client) -> None:
        # Three at once on one slot: two of them queue. They go at a barrier, and each
        # answer holds the slot for 0.25 s (40 tokens at 200/s), so the two that wait
        # queue for 0.25 and 0.5 s, unless their starts are further apart than an answer.
        barrier = threading.Barrier(3)

        def one(_: int) -> httpx.Response:
            barrier.wait(timeout=30)
            return client.post(CHAT, json=_chat(max_tokens=40))

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            list(pool.map(one, range(3)))

    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        page = open_page(proxy.url + "/ui?interval=300")
        page.wait_for_scrapes(1)
        assert "--enable-per-request-metrics" in page.page.inner_text("#chart-split")
        before = client.get("/metrics").text
        page.wait_for_scrapes(page.scrapes() + 1)
        burst(client)
        proxy.wait_records(3, timeout=10)
        now = metrics_after(client, 3)
        page.wait_for_scrapes(page.scrapes() + 2)

    split = _split(before, now)
    whole = sum(split.values())
    assert split["queue"] > 0.05  # two of the three waited for the slot
    assert page.stat("ttft_queue") == pytest.approx(100 * split["queue"] / whole, rel=1e-6)
    assert page.stat("ttft_outside") == pytest.approx(100 * split["outside"] / whole, rel=1e-6)
    assert page.page.query_selector("#chart-split canvas") is not None
    assert page.errors == []


def test_page_asks_for_the_metrics_token_and_keeps_it_in_memory_only(
    sim: Running, start_proxy: Callable[..., ProxyUnderTest], open_page: Callable[[str], Page]
) -> None:
    proxy = start_proxy(sim.url, metrics_token="s3cret-token")
    page = open_page(proxy.url + "/ui?interval=300")
    form = page.page.locator("#token-form")
    form.wait_for(state="visible")
    page.page.fill("#token", "wrong")
    page.page.click("#token-form button")
    # A locator's wait, not wait_for_function: a string predicate that is not true at
    # once is polled with eval, which the page's CSP (script-src 'self') refuses.
    page.page.locator("#token-why", has_text="refused").wait_for()
    assert page.scrapes() == 0
    page.page.fill("#token", "s3cret-token")
    page.page.click("#token-form button")
    httpx.post(proxy.url + CHAT, json=_chat(), headers={"x-sim-output-tokens": "3"})
    page.wait_for_scrapes(3)
    assert form.is_hidden()
    stored = page.page.evaluate(
        "JSON.stringify([localStorage, sessionStorage, document.cookie, location.href])"
    )
    assert "s3cret" not in stored
    # the only errors: the browser's own notes on the two refused /metrics fetches
    assert [e for e in page.errors if "401" not in e] == []
    assert len(page.errors) == 2


@paths("wire", why="the workers' counts meet in the metrics directory, whichever relay made them")
def test_page_reads_the_aggregated_metrics_of_two_workers(
    sim: Running, open_page: Callable[[str], Page], tmp_path: Path
) -> None:
    port = free_port()
    proxy = subprocess.Popen(
        [*SERVE, "--upstream", sim.url, "--port", str(port), "--workers", "2"],
        env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(base + "/ui", timeout=0.5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proxy.poll() is None, "serve did not start"
            time.sleep(0.05)
        page = open_page(base + "/ui?interval=300")
        page.wait_for_scrapes(1)
        n = 12
        for _ in range(n):  # a fresh connection each, so both workers take requests
            httpx.post(
                base + CHAT,
                json=_chat(),
                headers={"x-sim-ttft": "0", "x-sim-output-tokens": "3", "connection": "close"},
            )
        deadline = time.monotonic() + 20
        while page.outcomes().get("success") != n:
            assert time.monotonic() < deadline, page.outcomes()
            page.page.wait_for_timeout(100)
        assert page.errors == []
    finally:
        proxy.terminate()
        proxy.wait(10)


@paths("wire", why="the demo runs its proxy as serve does, on the wire")
def test_demo_serve_prints_the_live_view_first_and_keeps_it_busy(
    open_page: Callable[[str], Page],
) -> None:
    """`tokenprobe demo --serve` leads with the /ui address and keeps traffic going.

    TOKENPROBE_UI_SCREENSHOT=docs/ui.png (with TOKENPROBE_UI_SCREENSHOT_SECONDS=75 for a
    fuller picture) saves the README's screenshot from this run."""
    demo = subprocess.Popen(
        [sys.executable, "-m", "proxy", "demo", "--serve", "--port", "0", "--rounds", "1"],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert demo.stdout is not None
        first = demo.stdout.readline()
        assert first.startswith("live view") and first.split()[2].endswith("/ui"), first
        url = first.split()[2]
        target = os.environ.get("TOKENPROBE_UI_SCREENSHOT")
        page = open_page(url if target else url + "?interval=500")  # the picture: as shipped
        deadline = time.monotonic() + 30
        while not ({"success", "auth", "context_length"} <= set(page.outcomes())):
            assert time.monotonic() < deadline, page.outcomes()
            page.page.wait_for_timeout(200)
        seen = page.outcomes()["success"]
        page.wait_for_scrapes(page.scrapes() + 4)
        assert page.outcomes()["success"] > seen  # traffic goes on after the table
        if target:
            page.page.wait_for_timeout(
                1000 * float(os.environ.get("TOKENPROBE_UI_SCREENSHOT_SECONDS", "0"))
            )
            page.page.screenshot(path=target, full_page=True)
        assert page.errors == []
    finally:
        demo.terminate()
        demo.wait(10)


@paths("wire", why="the wire tunnels WebSockets; the ASGI app refuses them")
def test_page_shows_the_real_time_factor_once_realtime_sessions_run(
    sim: Running, open_page: Callable[[str], Page]
) -> None:
    """Behind `tokenprobe serve` (the wire tunnels WebSockets): the chart waits with a line
    saying why, then draws once an utterance on /v1/realtime has ended."""
    import base64

    import orjson
    from websockets.sync.client import connect

    from proxy.core.wav import pcm16

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proxy = subprocess.Popen([*SERVE, "--upstream", sim.url, "--port", str(port)])
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(base + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "tokenprobe serve did not come up"
            time.sleep(0.05)
        page = open_page(base + "/ui?interval=300")
        page.wait_for_scrapes(2)
        assert "No realtime transcription yet" in (page.page.inner_text("#chart-rtf") or "")
        audio = base64.b64encode(pcm16(0.5)).decode()
        with connect(base.replace("http", "ws") + "/v1/realtime") as ws:
            ws.recv(timeout=10)
            ws.send(orjson.dumps({"type": "session.update", "model": MODEL}).decode())
            for event in (
                {"type": "input_audio_buffer.append", "audio": audio},
                {"type": "input_audio_buffer.commit"},
                {"type": "input_audio_buffer.commit", "final": True},
            ):
                ws.send(orjson.dumps(event).decode())
            while "transcription.done" not in str(ws.recv(timeout=10)):
                pass
        deadline = time.monotonic() + 20
        while page.page.query_selector("#chart-rtf canvas") is None:
            assert time.monotonic() < deadline, page.page.inner_text("#chart-rtf")
            page.page.wait_for_timeout(100)
        assert page.errors == []
    finally:
        proxy.terminate()
        proxy.wait(10)


def test_page_shows_slo_attainment_as_promql_reads_the_counters(
    sim: Running, start_proxy: Callable[..., ProxyUnderTest], open_page: Callable[[str], Page]
) -> None:
    proxy = start_proxy(sim.url, slo="ttft=0.25")
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        page = open_page(proxy.url + "/ui?interval=300")
        page.wait_for_scrapes(1)
        before = client.get("/metrics").text
        page.wait_for_scrapes(page.scrapes() + 1)
        for ttft in ("0", "0", "0", "0.6", "0.6"):  # three within 0.25 s, two far beyond
            client.post(
                CHAT, json=_chat(), headers={"x-sim-ttft": ttft, "x-sim-output-tokens": "4"}
            )
        client.post(CHAT, json=_chat(), headers={"x-sim-error": "rate_limit"})  # an error: a miss
        proxy.wait_records(6, timeout=10)
        now = metrics_after(client, 6)
        page.wait_for_scrapes(page.scrapes() + 2)

    old, new = _series(before, now)
    judged = met = 0.0
    for (name, labels), value in new.items():
        if name == "tokenprobe_slo_requests_total":
            delta = _increase(old.get((name, labels)), value)
            judged += delta
            met += delta if dict(labels)["result"] == "met" else 0.0
    assert (met, judged) == (3, 6)
    assert page.stat("slo_attainment") == pytest.approx(100 * met / judged)
    assert page.page.query_selector("#chart-slo canvas") is not None
    assert page.errors == []


def _conversations(before: str, now: str) -> dict[str, Any]:
    """What PromQL reads of the conversation series over the window: the turn gap's bucket
    increases, the cached ratio's sum and count increases, the misses, continuations."""
    old, new = _series(before, now)
    out: dict[str, Any] = {"gap": {}, "ratio_sum": 0.0, "ratio_count": 0.0, "misses": 0.0}
    out["continuations"] = 0.0
    for (name, labels), value in new.items():
        delta = _increase(old.get((name, labels)), value)
        if name == "tokenprobe_conversation_turn_gap_seconds_bucket":
            le = float(dict(labels)["le"])
            out["gap"][le] = out["gap"].get(le, 0.0) + delta
        elif name == "tokenprobe_continuation_cached_prompt_ratio_sum":
            out["ratio_sum"] += delta
        elif name == "tokenprobe_continuation_cached_prompt_ratio_count":
            out["ratio_count"] += delta
        elif name == "tokenprobe_continuation_cache_misses_total":
            out["misses"] += delta
        elif name == "tokenprobe_conversation_continuations_total":
            out["continuations"] += delta
    out["open"] = new[("tokenprobe_conversations_open", frozenset())]
    return out


def test_page_shows_conversations_as_promql_reads_them(
    start_sim: Callable[..., Running],
    start_proxy: Callable[..., ProxyUnderTest],
    open_page: Callable[[str], Page],
) -> None:
    sim = start_sim(ttft=0.0, tokens_per_second=5000.0, output_tokens=4, prefix_cache=1000)
    sim.app.config.prefix_cache_block = 1  # cached tokens exactly the shared prefix
    sim.app.prefix_cache.block = 1
    proxy = start_proxy(sim.url, conversation_header="x-session-id")

    def turn(client: httpx.Client, messages: list[Any], **headers: str) -> None:
        body = {**_chat(), "messages": messages}
        assert client.post(CHAT, json=body, headers=headers).status_code == 200

    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        page = open_page(proxy.url + "/ui?interval=300")
        page.wait_for_scrapes(1)
        assert page.stat("conversations_open") == 0
        before = client.get("/metrics").text
        page.wait_for_scrapes(page.scrapes() + 1)
        # Three turns by their messages, 0.1 s and 0.3 s of tool between; two turns of one
        # header, the second recomputed by the backend (a miss).
        messages: list[Any] = [{"role": "user", "content": "Weather in Oslo, and in Bergen?"}]
        for sleep in (0.1, 0.3, None):
            turn(client, messages)
            if sleep is None:
                break
            time.sleep(sleep)
            messages += [
                {"role": "assistant", "content": "Rain."},
                {"role": "user", "content": "And then?"},
            ]
        other = [{"role": "user", "content": "Tell me about Lisbon."}]
        turn(client, other, **{"x-session-id": "sess-lisbon"})
        time.sleep(0.6)
        other += [{"role": "assistant", "content": "Hills."}, {"role": "user", "content": "?"}]
        turn(client, other, **{"x-session-id": "sess-lisbon", "x-sim-cached-tokens": "0"})
        proxy.wait_records(5, timeout=10)
        now = metrics_after(client, 5)
        page.wait_for_scrapes(page.scrapes() + 2)

    seen = _conversations(before, now)
    counts = (seen["continuations"], seen["ratio_count"], seen["misses"], seen["open"])
    assert counts == (3, 3, 1, 2)
    expected_gap = histogram_quantile(0.5, seen["gap"])
    assert 0.1 < expected_gap < 1.0  # the median gap: 0.3 s and the client's own time
    assert page.stat("conversations_open") == 2
    assert page.stat("continuations") == 3
    assert page.stat("turn_gap_p50") == pytest.approx(expected_gap, rel=1e-9)
    assert page.stat("turn_gap_p95") == pytest.approx(histogram_quantile(0.95, seen["gap"]))
    cached = 100 * seen["ratio_sum"] / seen["ratio_count"]
    assert cached == pytest.approx(100 * 2 / 3)  # two whole prefixes cached, one not at all
    assert page.stat("continuation_cached") == pytest.approx(cached, rel=1e-9)
    assert page.stat("continuation_misses") == pytest.approx(100 / 3)
    assert page.errors == []
