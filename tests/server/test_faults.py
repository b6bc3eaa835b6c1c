"""Faults and hostile input: each has a defined outcome, a metric, and leaves nothing behind."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable

import httpx
import pytest

from proxy.core.measurement import ErrorType
from tests.conftest import MODEL, ProxyUnderTest, Running

CHAT = "/v1/chat/completions"
BODY = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}


def proxy_tasks(proxy: ProxyUnderTest) -> int:
    loop = proxy.server.loop
    assert loop is not None

    async def count() -> int:
        return len(asyncio.all_tasks())

    return asyncio.run_coroutine_threadsafe(count(), loop).result(5)


def settle(sim: Running, proxy: ProxyUnderTest, baseline_tasks: int) -> None:
    """Upstream requests, in-flight gauges and tasks all back to where they started."""
    state = sim.app.state
    assert state.wait_for(lambda: state.active == 0, timeout=3), "sim still has requests open"
    deadline = time.monotonic() + 3
    while proxy_tasks(proxy) > baseline_tasks and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proxy_tasks(proxy) <= baseline_tasks
    assert proxy.sample("tokenprobe_requests_in_flight", model=MODEL, endpoint=CHAT) == 0


def raw_request(port: int, payload: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(payload)
    return sock


# -- client disconnects at every phase --------------------------------------------------


def _received(sock: socket.socket, marker: bytes) -> bool:
    """Read from the proxy until `marker` arrives (True) or the connection ends (False)."""
    sock.settimeout(5)
    seen = b""
    while marker not in seen:
        data = sock.recv(65536)
        if not data:
            return False
        seen = seen[-len(marker) :] + data
    return True


# What each phase waits for before the client goes away: the simulator holds the request
# (before the response head), has sent the head (the proxy relayed it: the client reads
# it), or has sent tokens, and an event reached the client.
PHASE_REACHED: dict[str, Callable[[Running, socket.socket], bool]] = {
    "before first byte": lambda sim, sock: True,
    "before first token": lambda sim, sock: _received(sock, b"\r\n\r\n"),
    "mid-stream": lambda sim, sock: (
        sim.app.state.wait_for(lambda: sim.app.state.last().completion_tokens >= 2)  # type: ignore[union-attr]
        and _received(sock, b"data: ")
    ),
    "non-streaming wait": lambda sim, sock: True,
}


@pytest.mark.quiet("a timing read within tens of milliseconds")
@pytest.mark.parametrize(
    ("phase", "headers", "stream"),
    [
        ("before first byte", {"x-sim-stall-before-headers": "5"}, True),
        ("before first token", {"x-sim-ttft": "5"}, True),
        (
            "mid-stream",
            {"x-sim-ttft": "0.05", "x-sim-tps": "20", "x-sim-output-tokens": "500"},
            True,
        ),
        ("non-streaming wait", {"x-sim-ttft": "5"}, False),
    ],
)
def test_client_disconnect_cancels_upstream_within_100ms(
    sim: Running,
    proxy: ProxyUnderTest,
    phase: str,
    headers: dict[str, str],
    stream: bool,
) -> None:
    baseline = proxy_tasks(proxy)
    body = {**BODY, "stream": stream}
    import orjson

    payload = orjson.dumps(body)
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sock = raw_request(
        proxy.server.port,
        f"POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{extra}content-length: {len(payload)}\r\n\r\n".encode()
        + payload,
    )
    state = sim.app.state
    assert state.wait_for(lambda: state.last() is not None, timeout=5), phase
    assert PHASE_REACHED[phase](sim, sock), phase
    assert state.last().outcome == "in_progress", phase  # type: ignore[union-attr]
    sock.close()
    closed = time.monotonic()
    assert state.wait_for(lambda: state.last().outcome == "aborted", timeout=2), phase  # type: ignore[union-attr]
    assert state.last().aborted_at - closed < 0.1, phase  # type: ignore[union-attr,operator]
    proxy.wait_records(1)
    assert proxy.records[0].error_type is ErrorType.CLIENT_CANCELLED
    assert (
        proxy.sample(
            "tokenprobe_requests_total",
            model=MODEL,
            endpoint=CHAT,
            code=str(proxy.records[0].status_code),
            finish_reason="none",
            error_type="client_cancelled",
        )
        == 1
    )
    settle(sim, proxy, baseline)


def test_client_disconnect_while_sending_the_body(sim: Running, proxy: ProxyUnderTest) -> None:
    baseline = proxy_tasks(proxy)
    sock = raw_request(
        proxy.server.port,
        f'POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-length: 5000\r\n\r\n{{"model": '.encode(),
    )
    time.sleep(0.2)
    sock.close()
    proxy.wait_records(1)
    assert proxy.records[0].error_type is ErrorType.CLIENT_CANCELLED
    assert sim.app.state.last() is None  # nothing was sent upstream
    settle(sim, proxy, baseline)


# -- upstream faults ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        ("malformed", None),
        ("non_utf8", None),
        ("huge_event", None),
        ("error_string", ErrorType.STREAM_ERROR),
        ("error_event", ErrorType.STREAM_ERROR),
        ("close_no_done", ErrorType.STREAM_TRUNCATED),
    ],
)
def test_stream_faults_relay_the_bytes_and_are_measured(
    sim: Running, proxy: ProxyUnderTest, fault: str, error: ErrorType | None
) -> None:
    import hashlib

    headers = {
        "x-sim-fault": fault,
        "x-sim-fault-after": "3",
        "x-sim-huge-bytes": str(6 * 1024 * 1024),
    }
    received = httpx.post(
        proxy.url + CHAT,
        json={**BODY, "stream_options": {"include_usage": True}},
        headers=headers,
        timeout=30,
    ).content
    sent = sim.app.state.last()
    assert sent is not None and sent.body_sha256 == hashlib.sha256(received).hexdigest()
    proxy.wait_records(1)
    assert proxy.records[0].error_type is error
    assert httpx.get(proxy.url + "/healthz").status_code == 200


def test_html_error_page_from_a_load_balancer_is_relayed_and_classified(
    sim: Running, proxy: ProxyUnderTest
) -> None:
    reply = httpx.post(proxy.url + CHAT, json=BODY, headers={"x-sim-error": "html_502"})
    assert reply.status_code == 502 and reply.headers["content-type"].startswith("text/html")
    proxy.wait_records(1)
    assert proxy.records[0].error_type is ErrorType.UPSTREAM_ERROR


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_memory_returns_to_baseline_after_huge_events(sim: Running) -> None:
    """A proxy process relaying 6 MiB single events ends up where it started."""
    import subprocess
    import sys

    from tests.servers import free_port, stop, wait_http

    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "proxy",
            "serve",
            "--upstream",
            sim.url,
            "--port",
            str(port),
            "--access-log",
            "off",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/healthz")
        headers = {
            "x-sim-fault": "huge_event",
            "x-sim-fault-after": "2",
            "x-sim-huge-bytes": str(6 * 1024 * 1024),
        }
        with httpx.Client(timeout=30) as client:
            for _ in range(3):  # warm-up: imports, pools, first allocations
                client.post(base + CHAT, json=BODY, headers=headers)
            baseline = rss_kib(process.pid)
            for _ in range(20):
                client.post(base + CHAT, json=BODY, headers=headers)
            time.sleep(0.5)
            after = rss_kib(process.pid)
        assert after - baseline < 16 * 1024, f"RSS grew {after - baseline} KiB"
    finally:
        stop(process)


# -- hostile input from clients ---------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "content_type"),
    [
        (b"", "application/json"),
        (b"{not json", "application/json"),
        (b'{"model": 42, "stream": true}', "application/json"),
        (b'{"model": ["a"], "messages": "x"}', "application/json"),
        (b"\xff\xfe\x00garbage", "application/json"),
        (b"model=x", "application/x-www-form-urlencoded"),
        (b"[1, 2, 3]", "text/plain"),
    ],
)
def test_bad_client_bodies_are_forwarded_and_never_crash_the_proxy(
    sim: Running, proxy: ProxyUnderTest, content: bytes, content_type: str
) -> None:
    reply = httpx.post(proxy.url + CHAT, content=content, headers={"content-type": content_type})
    assert reply.status_code == 400  # the backend judged it; the proxy relayed the verdict
    assert sim.app.state.last().path == CHAT  # type: ignore[union-attr]
    proxy.wait_records(1)
    assert proxy.records[0].error_type is ErrorType.BAD_REQUEST
    assert proxy.sample("tokenprobe_measurement_failures_total", stage="observe") == 0


def test_huge_headers_get_431_and_are_not_forwarded(sim: Running, proxy: ProxyUnderTest) -> None:
    # Over --max-header-bytes (64 KiB) and under the protocol's cap on a head as it
    # arrives (8 KiB more; over that the connection closes with no record, which
    # tests/server/test_edge_head.py covers): the admission check answers and records.
    reply = httpx.post(proxy.url + CHAT, json=BODY, headers={"x-big": "a" * 70_000})
    assert (
        reply.status_code == 431
        and reply.json()["error"]["type"] == "request_header_fields_too_large"
    )
    assert sim.app.state.last() is None
    proxy.wait_records(1)
    assert proxy.records[0].error_type is ErrorType.BAD_REQUEST
    assert httpx.get(proxy.url + "/healthz").status_code == 200


def test_slowloris_body_is_cut_off_by_the_body_timeout(
    sim: Running, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    proxy = start_proxy(sim.url, body_timeout=0.5)
    sock = raw_request(
        proxy.server.port,
        f"POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{{".encode(),
    )
    sock.settimeout(3)
    started = time.monotonic()
    reply = b""
    while chunk := sock.recv(4096):  # to the close: the rest of the body is still owed,
        reply += chunk  # so the connection ends with the answer, and the answer says so
    sock.close()
    assert reply.startswith(b"HTTP/1.1 408") and time.monotonic() - started < 1.5
    assert b"\r\nconnection: close\r\n" in reply.lower()
    assert sim.app.state.last() is None


def test_paths_outside_v1_reach_the_backend_and_its_answer_comes_back(
    sim: Running, proxy: ProxyUnderTest
) -> None:
    """Every route but the proxy's own is the backend's: its 404 comes back unchanged."""
    for path in ("/", "/admin", "/v2/chat/completions", "/v1"):
        sock = raw_request(
            proxy.server.port,
            f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode(),
        )
        sock.settimeout(3)
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
        sock.close()
        assert reply.startswith(b"HTTP/1.1 404"), path
        assert reply.endswith(b'{"detail":"Not Found"}'), path  # the simulator's own body
    assert proxy.sample("tokenprobe_passthrough_requests_total", route="/other", code="404") == 4
