"""A backend that dies mid-run stops the bench, naming the problem; one that answers
errors is measured to the end.

The dead backend is the simulator in its own process, killed once it has served a few
requests: the bench (its own process too) then fails every request at once, before any
response. It spun on those: 45,000 `upstream_unreachable` records in 5 s, a 73 MB JSON
reading `status: complete` (proxy/bench/load.py DEAD_REQUESTS, DEAD_SECONDS).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from proxy.bench.cli import main
from proxy.bench.load import DEAD_SECONDS
from proxy.sim import SimConfig, create_sim_app
from tests.conftest import MODEL
from tests.servers import ThreadedServer, free_port, spawn, stop, wait_http

LOADS = {"closed": ["--concurrency", "2"], "open": ["--rate", "50"]}

#: Long enough that a bench which never stops on its own is caught by the wait below.
DURATION = 60.0


def answered(url: str) -> int:
    """How many requests the simulator has answered to the end (its /sim/stats)."""
    stats = httpx.get(url + "/sim/stats", timeout=2.0).json()
    return int(stats["total"]) - int(stats["active"])


@pytest.mark.parametrize("load", LOADS)
def test_a_backend_that_dies_mid_run_stops_the_run_as_failing(load: str, tmp_path: Path) -> None:
    """Killed after a few answers, in either loop: the run stops DEAD_SECONDS or a little
    more after, as failing, the problem named as the fail-fast rule names it."""
    port = free_port()
    sim_url = f"http://127.0.0.1:{port}"
    sim = spawn("sim", "--host", "127.0.0.1", "--port", str(port), "--ttft", "0.05", "--tps", "200")
    out = tmp_path / "r.json"
    bench: subprocess.Popen[bytes] | None = None
    try:
        wait_http(sim_url + "/health")
        bench = subprocess.Popen(
            [sys.executable, "-m", "proxy.bench", "--url", sim_url + "/v1", "--model", MODEL,
             "--out", str(out), "--quiet", "--max-tokens", "4", "--duration", str(DURATION),
             *LOADS[load]],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while answered(sim_url) < 6:  # successes first: the backend dies mid-run
            assert time.monotonic() < deadline and bench.poll() is None, "the bench never ran"
            time.sleep(0.05)
        died = time.monotonic()  # before: the bench's failures all come after it
        sim.kill()
        sim.wait(10)
        try:
            _, err = bench.communicate(timeout=DEAD_SECONDS + 15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the bench went on {DEAD_SECONDS + 15:g} s after its backend died")
        stopped_after = time.monotonic() - died
    finally:
        stop(sim)
        if bench is not None:
            stop(bench)
    doc: dict[str, Any] = orjson.loads(out.read_bytes())
    errors = [r["error_type"] for r in doc["records"]]
    assert (doc["status"], bench.returncode) == ("failing", 1), err
    said = "the backend stopped answering mid-run, stopped: upstream_unreachable: cannot connect to"
    assert doc["problem"].startswith(said), doc["problem"]
    assert doc["problem"] in err.decode()  # named on stderr in one line too
    assert errors.count(None) >= 1 and "upstream_unreachable" in errors
    assert stopped_after >= DEAD_SECONDS  # a restart's blip would not have stopped it
    # no spinning: a closed loop backs off while nothing answers (it sent tens of
    # thousands in those seconds), an open loop sends on schedule (50/s here)
    assert len(errors) < 50 * (stopped_after + 5), len(errors)


class ErrorsAfter:
    """The simulator, which after `answered` requests answers each with `x-sim-error`'s
    `error` (vLLM's own error bodies and statuses, proxy/sim/errors.py), `STORM_PACE`
    seconds after it came."""

    #: Answered at once, the two clients' storm was 6,800 errors in 3.5 s and 2.2 s of
    #: CPU a test, for a check that needs more than DEAD_REQUESTS (50) in a row over
    #: DEAD_SECONDS; 10 ms apiece, it is about 570, in the same time.
    STORM_PACE = 0.01

    def __init__(self, app: Any, answered: int, error: str) -> None:
        self.app, self.answered, self.error = app, answered, error
        self.seen = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            self.seen += 1
            if self.seen > self.answered:
                await asyncio.sleep(self.STORM_PACE)
                headers = [*scope["headers"], (b"x-sim-error", self.error.encode())]
                scope = {**scope, "headers": headers}
        await self.app(scope, receive, send)


@pytest.mark.parametrize("error", ["rate_limit", "server_error"])
def test_a_backend_answering_errors_after_a_while_is_measured_to_the_end(
    error: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A 429 or 500 storm is an answer, whatever its number: a live but overloaded
    backend's, which the run measures (only no answer at all stops it)."""
    app = ErrorsAfter(create_sim_app(SimConfig(models=(MODEL,), ttft=0.02)), 4, error)
    server = ThreadedServer(app).start()
    out = tmp_path / "r.json"
    duration = DEAD_SECONDS + 1.5
    try:
        flags = ["--concurrency", "2", "--duration", f"{duration:g}", "--max-tokens", "4"]
        rc = main(["--url", server.url + "/v1", "--model", MODEL, "--out", str(out), "--quiet", *flags])  # fmt: skip
    finally:
        server.stop()
    err = capsys.readouterr().err
    doc: dict[str, Any] = orjson.loads(out.read_bytes())
    errors = [r["error_type"] for r in doc["records"]]
    kind = {"rate_limit": "rate_limit", "server_error": "upstream_error"}[error]
    assert rc == 0 and doc["status"] == "complete" and doc["problem"] is None, err
    assert errors.count(None) == 4 and errors.count(kind) == len(errors) - 4
    assert len(errors) > 50  # the storm ran well past the count that stops a dead backend


class _Shedder:
    """A live backend that sheds load by resetting: it relays at most LIMIT connections to
    the simulator at once and resets any more before a response (a gateway shedding)."""

    LIMIT = 4

    def __init__(self, upstream_port: int) -> None:
        import asyncio
        import socket
        import struct
        import threading

        self.port = free_port()
        self.active = 0
        loop = asyncio.new_event_loop()

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            except OSError:
                pass
            finally:
                w.close()

        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            if self.active >= self.LIMIT:
                await r.read(65536)
                sock = w.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                w.transport.abort()  # an RST before any response
                return
            self.active += 1
            try:
                ur, uw = await asyncio.open_connection("127.0.0.1", upstream_port)
                await asyncio.gather(pipe(r, uw), pipe(ur, w))
            finally:
                self.active -= 1

        async def serve() -> None:
            self._done = asyncio.Event()
            server = await asyncio.start_server(handle, "127.0.0.1", self.port)
            ready.set()
            await self._done.wait()  # set by `close`
            server.close()
            pipes = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in pipes:
                task.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)  # every pipe ended here

        ready = threading.Event()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_until_complete, args=(serve(),))
        self._thread.daemon = True
        self._thread.start()
        ready.wait(5)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._done.set)
        self._thread.join(10)
        self._loop.close()


def test_a_backend_that_resets_what_it_sheds_while_it_streams_is_not_stopped(
    tmp_path: Path,
) -> None:
    """Its long streams run on while every request over its limit is reset: those failures
    come in a row, but a request sent before them is still being answered, so the backend
    is alive (the run stopped after 2 s, its streams thrown away as cancelled)."""
    server = ThreadedServer(create_sim_app(SimConfig(ttft=0.01, tokens_per_second=40.0))).start()
    upstream_port = int(server.url.rsplit(":", 1)[1])
    shedder = _Shedder(upstream_port)
    try:
        out = tmp_path / "r.json"
        code = main(
            ["--url", f"http://127.0.0.1:{shedder.port}/v1", "--model", MODEL, "--rate", "40",
             "--duration", "3", "--max-tokens", "150", "--quiet", "--out", str(out)]
        )  # fmt: skip
    finally:
        shedder.close()
        server.stop()
    doc: dict[str, Any] = orjson.loads(out.read_bytes())
    assert doc["status"] == "complete", doc.get("problem")
    assert code == 0
    errors = [r["error_type"] for r in doc["records"]]
    assert errors.count(None) >= 1 and errors.count("upstream_error") >= 50
