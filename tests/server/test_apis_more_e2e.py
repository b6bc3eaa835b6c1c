"""The APIs added by issue 18 through a real `tokenprobe serve` process in front of the
simulator, each read by its own client (httpx for generate, the openai SDK for audio, the
cohere SDK for Cohere chat).

The simulator runs in-process and records the SHA-256 of every body it sent, so byte
identity is checked against exactly what went out; the proxy is its own process and its
records are read from its JSON access log (one line per request, proxy/sinks/logs.py).
"""

from __future__ import annotations

import hashlib
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from proxy.sim import SimApp, SimConfig
from proxy.sim.generate import token_ids
from proxy.sim.state import SimRequest
from tests.servers import ThreadedServer, free_port, spawn, stop, wait_http

MODEL = "sim-model"
TTFT = 0.25
SLACK = 0.5  # the proxy may add a little on a loaded machine, never take away
PROGRAM = {"x-sim-ttft": str(TTFT), "x-sim-tps": "100", "x-sim-output-tokens": "8"}


class Proxy:
    """A spawned `tokenprobe serve`, its access log read line by line as it comes."""

    def __init__(self, upstream: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = spawn(
            "serve", "--upstream", upstream, "--port", str(self.port), "--access-log", "json",
            stdout=subprocess.PIPE,
        )  # fmt: skip
        self.lines: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        wait_http(self.url + "/healthz")

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(b"{"):
                self.lines.append(orjson.loads(line))

    def record(self, n: int, timeout: float = 10.0) -> dict[str, Any]:
        """The n-th access-log line (1-based) once it is written."""
        deadline = time.monotonic() + timeout
        while len(self.lines) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(self.lines) >= n, self.lines
        return self.lines[n - 1]

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics").text


@pytest.fixture(scope="module")
def sim() -> Iterator[tuple[str, SimApp]]:
    app = SimApp(SimConfig(models=(MODEL,), ttft=0.05, tokens_per_second=200.0, record_bodies=True))
    server = ThreadedServer(app).start()
    try:
        yield server.url, app
    finally:
        server.stop()


@pytest.fixture(scope="module")
def proxy(sim: tuple[str, SimApp]) -> Iterator[Proxy]:
    running = Proxy(sim[0])
    try:
        yield running
    finally:
        stop(running.process)


@pytest.fixture
def n(proxy: Proxy) -> Iterator[int]:
    """The access-log line the test's first request will write."""
    yield len(proxy.lines) + 1


def sent(app: SimApp) -> SimRequest:
    last = app.state.last()
    assert last is not None
    return last  # type: ignore[no-any-return]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- /inference/v1/generate with httpx ------------------------------------------------------


def generate_body(stream: bool = True, **params: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "stream": stream,
        "token_ids": [1, 2, 3, 4, 5, 6, 7],
        "sampling_params": {"max_tokens": 32, **params},
    }


def test_generate_stream_through_the_proxy(sim: tuple[str, SimApp], proxy: Proxy, n: int) -> None:
    headers = {**PROGRAM, "x-sim-tokens-per-chunk": "3"}
    with httpx.stream(
        "POST", proxy.url + "/inference/v1/generate", json=generate_body(), headers=headers
    ) as r:
        received = b"".join(r.iter_raw())
    m, backend = proxy.record(n), sent(sim[1])
    assert sha(received) == backend.body_sha256
    ids = [
        i
        for line in received.split(b"\n\n")
        if line.startswith(b"data: {")
        for choice in orjson.loads(line[6:])["choices"]
        for i in choice["token_ids"]
    ]
    assert ids == token_ids(8)
    assert (m["endpoint"], m["error_type"], m["finish_reason"]) == (
        "/inference/v1/generate",
        None,
        "stop",
    )
    assert (m["prompt_tokens"], m["output_tokens"], m["token_source"]) == (7, 8, "token_ids")
    assert TTFT * 1000 <= m["ttft_ms"] < (TTFT + SLACK) * 1000


def test_generate_cut_by_max_tokens_is_length(
    sim: tuple[str, SimApp], proxy: Proxy, n: int
) -> None:
    body = generate_body(max_tokens=4, ignore_eos=True)
    httpx.post(proxy.url + "/inference/v1/generate", json=body, headers=PROGRAM)
    m = proxy.record(n)
    assert (m["output_tokens"], m["finish_reason"], m["token_source"]) == (4, "length", "token_ids")


def test_generate_not_streamed_counts_from_usage(
    sim: tuple[str, SimApp], proxy: Proxy, n: int
) -> None:
    r = httpx.post(proxy.url + "/inference/v1/generate", json=generate_body(False), headers=PROGRAM)
    m = proxy.record(n)
    assert r.json()["choices"][0]["token_ids"] == token_ids(8)
    assert sha(r.content) == sent(sim[1]).body_sha256
    assert (m["prompt_tokens"], m["output_tokens"], m["token_source"]) == (7, 8, "usage")


@pytest.mark.parametrize(
    ("headers", "error"),
    [
        ({"x-sim-error": "rate_limit"}, "rate_limit"),
        ({"x-sim-fault": "error_event", "x-sim-fault-after": "2"}, "stream_error"),
        ({"x-sim-fault": "close_no_done", "x-sim-fault-after": "2"}, "stream_truncated"),
        ({"x-sim-fault": "malformed", "x-sim-fault-after": "2"}, None),
    ],
)
def test_generate_error_classes(
    sim: tuple[str, SimApp], proxy: Proxy, n: int, headers: dict[str, str], error: str | None
) -> None:
    r = httpx.post(
        proxy.url + "/inference/v1/generate", json=generate_body(), headers={**PROGRAM, **headers}
    )
    m = proxy.record(n)
    assert sha(r.content) == sent(sim[1]).body_sha256
    assert (m["endpoint"], m["error_type"]) == ("/inference/v1/generate", error)
