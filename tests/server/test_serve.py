"""`tokenprobe serve` as a real process: start-up, graceful drain on SIGTERM, workers."""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.scrape import Scrape, scrape, wait_for
from tests.server.conftest import no_proxy, paths
from tests.servers import free_port, metrics_port_taken, spawn, stop, wait_http

CHAT = "/v1/chat/completions"
BODY = {"model": "sim-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def sim_url() -> Iterator[str]:
    """One simulator for the module, both data paths: every test tells it what to send
    in its requests' x-sim-* headers and reads nothing of its state. A process each was 18
    starts (run alone, the module took 3-4 s more CPU and about 6 s more time)."""
    port = free_port()
    process = spawn("sim", "--port", str(port))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health")
        yield url
    finally:
        stop(process)


def refuses_connections(url: str, timeout: float = 5.0) -> bool:
    """True once the server stops accepting (a connect error), polled until `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=1)
        except httpx.ConnectError:
            return True
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    return False


def drains(sim_url: str, tmp_path: Path, *flags: str) -> None:
    """`tokenprobe serve` with `flags`, a stream under way, SIGTERM: the stream ends
    whole, new connections are refused at once (with --workers the parent's copy of the
    socket once kept accepting them, and they hung for the whole drain), the process exits
    0, and a metrics directory it made for workers is gone with it."""
    port = free_port()
    proxy = spawn(
        "serve", "--upstream", sim_url, "--port", str(port), "--drain-timeout", "10",
        "--access-log", "off", *flags, env={"TMPDIR": str(tmp_path)},
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/healthz")
        result: dict[str, bytes] = {}
        under_way = threading.Event()

        def long_stream() -> None:
            headers = {"x-sim-ttft": "0.1", "x-sim-tps": "20", "x-sim-output-tokens": "100"}  # ~5 s
            body = b""
            with httpx.stream("POST", base + CHAT, json=BODY, headers=headers, timeout=30) as r:
                for chunk in r.iter_raw():
                    body += chunk
                    under_way.set()
            result["body"] = body

        client = threading.Thread(target=long_stream)
        client.start()
        assert under_way.wait(10), "the stream did not start"
        proxy.send_signal(signal.SIGTERM)
        # Within 3 s on a loaded machine, still well inside the ~5 s stream.
        assert refuses_connections(base + "/healthz", timeout=3.0), "still accepting after SIGTERM"
        assert "body" not in result  # refused while the stream was still under way
        client.join(15)
        assert proxy.wait(15) == 0
        body = result["body"]
        assert body.endswith(b"data: [DONE]\n\n") and body.count(b'"finish_reason":"stop"') == 1
        assert not list(tmp_path.glob("tokenprobe-metrics-*"))
    finally:
        stop(proxy)


def test_sigterm_lets_an_in_flight_stream_finish_then_exits_zero(
    sim_url: str, tmp_path: Path
) -> None:
    drains(sim_url, tmp_path)


@paths("wire", why="the listening socket is uvicorn's supervisor's, the same for both relays")
def test_with_workers_sigterm_refuses_new_connections_at_once(sim_url: str, tmp_path: Path) -> None:
    drains(sim_url, tmp_path, "--workers", "2")


def test_serve_starts_fast_without_a_tokenizer(sim_url: str) -> None:
    port = free_port()
    started = time.monotonic()
    proxy = spawn("serve", "--upstream", sim_url, "--port", str(port))
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz")
        # Holds with another job on the second core (a cold start then takes 2-4 s here);
        # loading a tokenizer or waiting on a hub would take longer. The figure itself is
        # the benchmark's (relay.py: start -> first request).
        assert time.monotonic() - started < 6.0
    finally:
        stop(proxy)


@paths("wire", why="the salts are drawn by the supervisor, for whichever relay its workers run")
def test_two_workers_hash_one_key_and_one_prompt_alike_without_a_salt_given(
    sim_url: str, tmp_path: Path
) -> None:
    """--key-label hash and the access log's prefix hashes without --key-salt or
    --log-salt: the random salt is drawn once for every worker (each worker drew its own:
    one API key was one `key` label per worker, one prompt one prefix hash per worker)."""
    port = free_port()
    log = tmp_path / "access.jsonl"
    with log.open("wb") as out:
        proxy = spawn(
            "serve", "--upstream", sim_url, "--port", str(port), "--workers", "2",
            "--key-label", "hash", "--access-log", "json", stdout=out.fileno(),
            env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom")},
        )  # fmt: skip
    (tmp_path / "prom").mkdir()
    base = f"http://127.0.0.1:{port}"
    headers = {"authorization": "Bearer sk-team-a-0001", "x-sim-ttft": "0",
               "x-sim-output-tokens": "2", "connection": "close"}  # fmt: skip
    n = 30
    try:
        wait_http(base + "/healthz")
        for _ in range(n):  # a fresh connection each time, so both workers take requests
            assert httpx.post(base + CHAT, json=BODY, headers=headers).status_code == 200
        wait_for(base, "tokenprobe_requests_total", n)
        page = scrape(base, headers={"connection": "close"})
    finally:
        stop(proxy)
    keys = {s.labels["key"] for s in page.series("tokenprobe_key_requests_total")}
    assert len(keys) == 1 and page.total("tokenprobe_key_requests_total") == n, keys
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    assert len(lines) == n and len({tuple(line["prefix"]) for line in lines}) == 1


def test_a_stream_in_flight_on_a_worker_that_dies_is_counted_lost(
    sim_url: str, tmp_path: Path
) -> None:
    """A worker killed mid-stream (SIGKILL: an OOM kill, a crash) writes no record: its
    client's connection is cut, and the stream was counted nowhere, its in-flight gauge
    dropped with the worker. The next scrape counts it in tokenprobe_requests_lost_total,
    whose series was exported at 0 from the pair's first request, `--label-header` or not:
    the alert reads the counter's increase, and a series that first appears at 1 has none."""
    (tmp_path / "prom").mkdir()
    port = free_port()
    proxy = spawn(
        "serve", "--upstream", sim_url, "--port", str(port), "--workers", "2",
        "--access-log", "off", "--label-header", "x-team=team",
        # the label from the allowlist, not from the model list a worker may not have read
        # yet when the stream starts (it was `other` then)
        "--model-allowlist", "sim-model",
        env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom")},
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    slow = {"x-sim-ttft": "0", "x-sim-tps": "20", "x-sim-output-tokens": "400"}
    try:
        wait_http(base + "/healthz")
        with httpx.stream("POST", base + CHAT, json=BODY, headers=slow, timeout=30) as response:
            stream = response.iter_raw()
            next(stream)  # the stream is under way
            (zero,) = scrape(base).series("tokenprobe_requests_lost_total")
            assert (zero.labels, zero.value) == ({"model": "sim-model", "endpoint": CHAT}, 0)
            workers = subprocess.run(["ps", "--ppid", str(proxy.pid), "-o", "pid="],
                                     capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
            assert workers
            for pid in workers:
                os.kill(int(pid), signal.SIGKILL)
            with pytest.raises(httpx.HTTPError):  # cut short, not ended
                for _ in stream:
                    pass
        # the supervisor starts new workers; the first scrape after counts the lost one
        wait_http(base + "/healthz")
        wait_for(base, "tokenprobe_requests_lost_total", 1)
        page = scrape(base)
        (lost,) = page.series("tokenprobe_requests_lost_total")
        assert (lost.labels, lost.value) == ({"model": "sim-model", "endpoint": CHAT}, 1), lost
        assert page.total("tokenprobe_requests_in_flight") == 0
        assert page.total("tokenprobe_requests_total") == 0  # no record was written
        assert scrape(base).total("tokenprobe_requests_lost_total") == 1  # counted once
    finally:
        stop(proxy)


@paths("wire", why="only the wire tunnels WebSockets (the ASGI relay refuses them)")
def test_a_websocket_session_open_on_a_worker_that_dies_is_counted_lost(
    sim_url: str, tmp_path: Path
) -> None:
    """As a stream is (above): a realtime session on a worker killed under it wrote no
    record, and its in-flight gauge went with the worker. The next scrape counts it as a
    session that ended `worker_died`, a series exported at 0 from the route's first session."""
    from websockets.sync.client import connect

    (tmp_path / "prom").mkdir()
    port = free_port()
    proxy = spawn(
        "serve", "--upstream", sim_url, "--port", str(port), "--workers", "2",
        "--access-log", "off", env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom")},
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    sessions = "tokenprobe_websocket_sessions_total"
    try:
        wait_http(base + "/healthz")
        url = f"ws://127.0.0.1:{port}/v1/realtime?model=sim-model"
        with connect(url, open_timeout=10) as ws:
            ws.recv(timeout=10)  # session.created: the tunnel is open
            page = scrape(base)
            assert page.total("tokenprobe_websocket_sessions_in_flight") == 1
            assert page.value(sessions, route="/v1/realtime", outcome="worker_died") == 0
            workers = subprocess.run(["ps", "--ppid", str(proxy.pid), "-o", "pid="],
                                     capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
            for pid in workers:
                os.kill(int(pid), signal.SIGKILL)
            with pytest.raises(Exception):  # noqa: B017 (the connection is cut, any way)
                ws.recv(timeout=10)
        wait_http(base + "/healthz")
        wait_for(base, sessions, 1)
        page = scrape(base)
        assert page.value(sessions, route="/v1/realtime", outcome="worker_died") == 1
        assert (
            page.total(sessions) == 1 and page.total("tokenprobe_websocket_sessions_in_flight") == 0
        )
        assert scrape(base).total(sessions) == 1  # counted once
    finally:
        stop(proxy)


@paths("wire", why="the workers' counts meet in the metrics directory, whichever relay made them")
def test_two_workers_report_exact_totals_on_every_scrape(sim_url: str, tmp_path: object) -> None:
    port = free_port()
    proxy = spawn(
        "serve",
        "--upstream",
        sim_url,
        "--port",
        str(port),
        "--workers",
        "2",
        "--access-log",
        "off",
        env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/healthz")
        n = 30
        with httpx.Client(base_url=base, timeout=10) as client:
            for _ in range(n):
                # a fresh connection each time, so both workers take requests
                httpx.post(
                    base + CHAT,
                    json=BODY,
                    headers={"x-sim-ttft": "0", "x-sim-output-tokens": "3", "connection": "close"},
                )
            # a request is recorded just after its last byte: wait for the last one, then
            # every scrape, by whichever worker, must say exactly n
            wait_for(base, "tokenprobe_requests_total", n)
            counts = []
            for _ in range(10):
                scraped = scrape(base, headers={"connection": "close"})
                counts.append(scraped.total("tokenprobe_requests_total"))
            del client
        assert counts == [n] * 10
        # a name[] scrape is answered from every worker's files too (it was empty)
        page = httpx.get(base + "/metrics?name[]=tokenprobe_requests_total", timeout=10).text
        assert Scrape.parse(page).total("tokenprobe_requests_total") == n
    finally:
        stop(proxy)


@paths("wire", why="the metrics directory is made ready at start, before either relay serves")
def test_one_worker_in_multiprocess_mode_starts_from_a_fresh_directory(
    sim_url: str, tmp_path: Path
) -> None:
    """PROMETHEUS_MULTIPROC_DIR set and one worker: the directory is emptied at start, as
    with several (a previous run's counters were summed in), and made when missing (the
    start failed with a traceback)."""
    old = tmp_path / "metrics"
    old.mkdir()
    counted = (  # a previous run's worker, 5 requests counted
        "import os, sys; os.environ['PROMETHEUS_MULTIPROC_DIR'] = sys.argv[1]\n"
        "from prometheus_client import CollectorRegistry\n"
        "from proxy.sinks.metrics import Metrics\n"
        "Metrics(CollectorRegistry()).requests.labels("
        "'m', '/v1/chat/completions', '200', 'stop', 'none').inc(5)\n"
    )
    subprocess.run([sys.executable, "-c", counted, str(old)], check=True)
    for directory in (old, tmp_path / "missing" / "metrics"):
        port = free_port()
        env = {"PROMETHEUS_MULTIPROC_DIR": str(directory)}
        proxy = spawn("serve", "--upstream", sim_url, "--port", str(port), env=env)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_http(base + "/healthz")
            assert scrape(base).total("tokenprobe_requests_total") == 0, directory
        finally:
            stop(proxy)
    not_a_directory = tmp_path / "a-file"
    not_a_directory.write_text("")
    out = subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--upstream", sim_url, "--port", "0"],
        capture_output=True,
        text=True,
        env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(not_a_directory)},
    )
    assert out.returncode == 2 and "PROMETHEUS_MULTIPROC_DIR=" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


@paths("wire", why="the metrics directory is the process's, whichever relay it runs")
def test_a_second_proxy_given_the_same_metrics_directory_refuses_to_start(
    tmp_path: Path,
) -> None:
    """It cleared the first's files at its start: the first's counters went back to 0, and
    each then reported the other's traffic. Now it names the first and exits 2."""
    directory = str(tmp_path / "metrics")
    env = {"PROMETHEUS_MULTIPROC_DIR": directory}
    port = free_port()
    first = spawn("serve", "--upstream", "http://127.0.0.1:9", "--port", str(port), env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/healthz")
        for _ in range(3):  # the upstream is down: three 502s, counted
            assert httpx.post(base + CHAT, json=BODY).status_code == 502
        assert scrape(base).total("tokenprobe_requests_total") == 3
        second = subprocess.run(
            [sys.executable, "-m", "proxy", "serve", "--upstream", "http://127.0.0.1:9",
             "--port", "0"],
            env={**os.environ, **env}, capture_output=True, text=True, timeout=10,
        )  # fmt: skip
        assert second.returncode == 2, second.stderr
        assert f"PROMETHEUS_MULTIPROC_DIR={directory!r}: process {first.pid} " in second.stderr
        assert scrape(base).total("tokenprobe_requests_total") == 3
    finally:
        stop(first)


@no_proxy
def test_a_metrics_port_in_use_is_said_in_a_line_naming_it_without_a_traceback() -> None:
    """As --port in use is: uvicorn's bind failure, then why, exit 3 (the metrics listener's
    sys.exit escaped its task: a traceback through the event loop)."""
    port, out = metrics_port_taken()
    assert out.returncode == 3, out.stderr
    assert f"--metrics-port {port}: cannot listen on 127.0.0.1:{port}" in out.stderr
    assert "Traceback" not in out.stderr, out.stderr


@no_proxy
def test_serve_without_upstream_says_what_to_set() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "proxy", "serve"],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("TOKENPROBE_")},
    )
    assert out.returncode == 2
    assert "TOKENPROBE_UPSTREAM" in out.stderr and "--upstream" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_streams_outliving_the_drain_are_cut_counted_and_not_logged_as_crashes(
    sim_url: str,
) -> None:
    port = free_port()
    proxy = spawn(
        "serve", "--upstream", sim_url, "--port", str(port), "--drain-timeout", "1",
        "--access-log", "json", "--log-level", "warning", stdout=subprocess.PIPE,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/healthz")
        errors: list[BaseException] = []

        under_way = threading.Event()

        def long_stream() -> None:
            headers = {"x-sim-ttft": "0.05", "x-sim-tps": "10", "x-sim-output-tokens": "100"}
            try:
                with httpx.stream("POST", base + CHAT, json=BODY, headers=headers, timeout=30) as r:
                    for _ in r.iter_raw():
                        under_way.set()
            except httpx.HTTPError as exc:
                errors.append(exc)

        client = threading.Thread(target=long_stream)
        client.start()
        assert under_way.wait(10), "the stream did not start"
        proxy.send_signal(signal.SIGTERM)
        client.join(15)
        assert proxy.wait(15) == 0
        assert len(errors) == 1 and isinstance(errors[0], httpx.RemoteProtocolError)
        stderr = proxy.stderr.read().decode() if proxy.stderr else ""
        assert "Traceback" not in stderr and "Exception in ASGI application" not in stderr
        log = proxy.stdout.read().decode() if proxy.stdout else ""
        assert '"error_type":"stream_truncated"' in log, log
    finally:
        stop(proxy)


def test_a_request_still_uploading_at_the_drain_end_gets_the_503_and_one_log_line(
    sim_url: str,
) -> None:
    """Its answer had not begun by the drain's limit: the 503 JSON error such a request
    gets, one access-log line, exit 0, no crash logged. The wire once closed it silently;
    the ASGI relay let uvicorn's cancellation escape (its 500 and a traceback)."""
    port = free_port()
    proxy = spawn(
        "serve", "--upstream", sim_url, "--port", str(port), "--drain-timeout", "1",
        "--body-timeout", "30", "--access-log", "json", "--log-level", "warning",
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                b'content-type: application/json\r\ncontent-length: 100\r\n\r\n{"model":"'
            )
            time.sleep(0.3)  # the head is in
            proxy.send_signal(signal.SIGTERM)
            reply = b""
            while part := sock.recv(65536):
                reply += part
        assert proxy.wait(15) == 0
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 "), reply
        assert json.loads(body)["error"]["type"] == "proxy_shutting_down"
        stderr = proxy.stderr.read().decode() if proxy.stderr else ""
        assert "Traceback" not in stderr and "Exception in ASGI application" not in stderr
        lines = (proxy.stdout.read().decode() if proxy.stdout else "").splitlines()
        assert len(lines) == 1, lines
        record = json.loads(lines[0])
        assert (record["status"], record["error_type"]) == (503, "upstream_error")
    finally:
        stop(proxy)


_WITHOUT_TRANSFORMERS = """
import sys

class HideTransformers:  # as if `pip install .` had not installed the tokenizer extra
    def find_spec(self, name, path=None, target=None):
        if name == "transformers" or name.startswith("transformers."):
            raise ModuleNotFoundError("No module named 'transformers'")
        return None

sys.meta_path.insert(0, HideTransformers())
from proxy.cli import main
sys.exit(main(sys.argv[1:]))
"""


@no_proxy
def test_serve_refuses_a_tokenizer_it_cannot_load_and_names_the_extra(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _WITHOUT_TRANSFORMERS,
            "serve",
            "--upstream",
            "http://127.0.0.1:9",
            "--port",
            "0",
            "--tokenizer",
            str(tmp_path),
        ],
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == 2
    message = result.stderr.decode()
    assert (
        "transformers" in message and "pip install '.[tokenizer]' in tokenprobe's clone" in message
    )
    assert str(tmp_path) in message


FREEZE_PROBE = """
import asyncio, gc, sys
from proxy.server.assemble import assemble
from proxy.server.serve import build_app
from proxy.settings import Settings

async def started(app):
    await app.startup()
    frozen = gc.get_freeze_count()
    await app.shutdown()
    return frozen

settings = Settings(upstream="http://127.0.0.1:9", models_refresh=None, access_log="off")
print(asyncio.run(started(build_app(settings))), asyncio.run(started(assemble(settings, {}))))
"""


@no_proxy
def test_a_serving_process_freezes_its_startup_heap_and_an_app_built_in_code_does_not() -> None:
    # proxy/server/heap.py: a full collection walked the whole startup heap and stopped
    # every stream for 20-48 ms under scrape load. What startup built is frozen (out of
    # the collector's walk) in a serving process only; a test process building many
    # apps keeps collecting their garbage.
    run = subprocess.run(
        [sys.executable, "-c", FREEZE_PROBE], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr[-2000:]
    served, in_code = map(int, run.stdout.split())
    assert served > 20_000  # the imports and the assembly: 60,582 here
    assert in_code <= served  # the second app froze nothing more (frozen objects freed since go)


IMPORTS_PROBE = """
import asyncio, os, sys
from proxy.server.serve import build_app
from proxy.settings import Settings

async def started(app):
    await app.startup()
    await app.shutdown()

relay, traces = sys.argv[1:]
if traces != "none":
    os.environ["OTEL_TRACES_EXPORTER"] = traces
asyncio.run(started(build_app(Settings(upstream="http://127.0.0.1:9", relay=relay, models_refresh=None, access_log="off"))))
print("aiohttp" in sys.modules, "opentelemetry.sdk.trace" in sys.modules)
"""


@functools.cache  # a process each: the two tests below both read the wire's without traces
def imported_by(relay: str, traces: str) -> tuple[str, ...]:
    """Whether a started app of `relay`, OTEL_TRACES_EXPORTER=`traces`, imported aiohttp
    and the OpenTelemetry tracing SDK."""
    run = subprocess.run(
        [sys.executable, "-c", IMPORTS_PROBE, relay, traces],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return tuple(run.stdout.split())


@no_proxy
@pytest.mark.parametrize(("relay", "imported"), [("wire", False), ("asgi", True)])
def test_a_wire_process_never_imports_aiohttp_and_an_asgi_relay_does(
    relay: str, imported: bool
) -> None:
    # proxy/server/upstream_aiohttp.py: aiohttp is 0.1 s of a proxy's start (0.415 to
    # 0.324 s to a first /healthz here). On the wire the relay's client only asks the
    # backend's control-plane routes, on httpx's own transport; the ASGI relay keeps the
    # default --upstream-transport, aiohttp.
    assert imported_by(relay, "none")[0] == str(imported)


@no_proxy
def test_the_tracing_sdk_is_imported_only_when_traces_are_asked_for() -> None:
    # proxy/server/assemble.py asks otel_env.traces_requested first: the SDK and
    # proxy/sinks/tracing.py are 35 ms of every start that exports no traces.
    assert imported_by("wire", "none")[1] == "False"
    assert imported_by("wire", "console")[1] == "True"
