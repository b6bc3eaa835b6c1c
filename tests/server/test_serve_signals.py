"""`tokenprobe serve` as a real process stopped by a signal, and refused a port in use.

Ctrl-C in a terminal sends SIGINT to the whole foreground process group: the server and,
with --workers, every worker. The processes here lead a group of their own, and the
signal goes to the group, as the terminal sends it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from uvicorn.config import STARTUP_FAILURE

from tests.conftest import MODEL, Running
from tests.server.conftest import no_proxy, paths
from tests.servers import free_port, serve_with_a_port_taken, spawn, stop_group

#: uvicorn's lines as a server stops, each followed by what varies (a process id).
SHUTDOWN = (
    "Shutting down",
    "Waiting for application shutdown.",
    "Application shutdown complete.",
    "Finished server process",
    "Stopping parent process",
)


@contextlib.contextmanager
def serving(
    workers: int, upstream: str = "http://127.0.0.1:9"
) -> Iterator[tuple[subprocess.Popen[bytes], list[str], int]]:
    """A `tokenprobe serve` with `workers` processes started, every one of them serving,
    leading a process group of its own: (the process, its stderr's lines so far, its
    port). The group is stopped at the end, whatever is left of it.

    /healthz answers once one worker serves; a worker still starting when a signal comes
    stops otherwise (a worker still importing raises KeyboardInterrupt in multiprocessing's
    start-up), so the log is read until each has said it started."""
    port = free_port()
    proxy = spawn(
        "serve", "--upstream", upstream, "--port", str(port),
        "--models-refresh", "0", "--workers", str(workers), preexec_fn=os.setsid,
    )  # fmt: skip
    lines: list[str] = []
    stderr = proxy.stderr
    assert stderr is not None
    reader = threading.Thread(target=lambda: lines.extend(line.decode() for line in stderr))
    reader.start()
    try:
        deadline = time.monotonic() + 60  # a cold start takes 2-4 s on a loaded machine
        while sum("Application startup complete." in line for line in lines) < workers:
            assert proxy.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.05)
        # One process says its application started before its port listens (uvicorn's
        # Server.startup: the lifespan, then the server that listens): a CI run's request
        # came between the two and was refused. The port answers before anything is sent.
        while not _listens(port):
            assert proxy.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.05)
        yield proxy, lines, port
    finally:
        stop_group(proxy)
        reader.join(10)


def _listens(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:`port`."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def stopped_by(sig: signal.Signals, workers: int) -> tuple[int, str]:
    """A serving `tokenprobe serve` (`serving`) sent `sig` to its process group: its exit
    status and its stderr."""
    with serving(workers) as (proxy, lines, _):
        os.killpg(proxy.pid, sig)
        proxy.wait(60)  # a drain with nothing in flight: about a second
    return proxy.returncode, "".join(lines)


def group_gone(group: int, timeout: float) -> bool:
    """Whether every process of `group` has ended within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def shutdown_lines(log: str) -> list[str]:
    """What each line of `log` says of the stop, sorted: workers stop in any order."""
    return sorted(said for line in log.splitlines() for said in SHUTDOWN if said in line)


@paths("wire", why="the signals are uvicorn's and serve's, the same for both relays")
@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "two-workers"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_stops_cleanly_as_sigterm_does(sig: signal.Signals, workers: int) -> None:
    """One process raised uvicorn's re-raised SIGINT as asyncio's KeyboardInterrupt after
    its clean shutdown: a traceback, and death by SIGINT (130 in a shell). uvicorn's own
    command exits 0 after Ctrl-C, as serve does after SIGTERM."""
    status, log = stopped_by(sig, workers)
    assert status == 0, log
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
    each = ["Application shutdown complete.", "Finished server process", "Shutting down"]
    each += ["Waiting for application shutdown."]
    expected = sorted(each * workers + (["Stopping parent process"] if workers > 1 else []))
    assert shutdown_lines(log) == expected, log


@no_proxy
def test_workers_drain_and_end_when_their_supervisor_is_killed() -> None:
    """Killed with SIGKILL (an OOM kill, `kill -9`), the supervisor left its workers
    serving the port, with nobody to restart one that died, and a new `serve` on that
    port refused to start. Each worker now drains and ends with it, as gunicorn's do."""
    with serving(2) as (proxy, lines, port):
        os.kill(proxy.pid, signal.SIGKILL)  # the parent only: its workers stay
        proxy.wait(10)
        assert group_gone(proxy.pid, timeout=30), "".join(lines)
        said = "".join(lines)
    assert said.count("Finished server process") == 2, said  # each drained, then ended
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)


@paths("wire", why="the signal is serve's, the same for both relays")
def test_sighup_to_one_process_drains_its_streams_before_it_ends(
    start_sim: Callable[..., Running],
) -> None:
    """SIGHUP (a closed terminal, `systemctl reload`) ended one process at once, every
    stream cut and none recorded; --workers replaced the workers drained. Now the process
    drains, then ends by SIGHUP as before (a supervisor still sees a signal's death)."""
    sim = start_sim(ttft=0.0, tokens_per_second=20.0, output_tokens=30)
    with serving(1, sim.url) as (proxy, lines, port):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        with httpx.stream("POST", url, json={**body, "max_tokens": 30}, timeout=30) as stream:
            events = stream.iter_lines()
            assert next(events).startswith("data:")  # in flight: the signal comes now
            os.kill(proxy.pid, signal.SIGHUP)
            rest = list(events)
        assert proxy.wait(60) == -signal.SIGHUP, "".join(lines)
    assert "data: [DONE]" in rest, rest  # the whole stream: about 1.5 s after the signal
    assert "Finished server process" in "".join(lines)


@no_proxy
@pytest.mark.parametrize("workers", ["1", "2"], ids=["one-process", "two-workers"])
def test_a_port_in_use_is_one_line_naming_the_address(workers: str) -> None:
    """With --workers uvicorn's supervisor said only "[Errno 98] Address already in use";
    one process started the whole app first, then said it in asyncio's words."""
    port, out = serve_with_a_port_taken("--port", "{port}", "--workers", workers)
    assert out.returncode == STARTUP_FAILURE, out.stderr
    line = f"tokenprobe serve: --port {port}: cannot listen on 127.0.0.1:{port} ("
    said = [text for text in out.stderr.splitlines() if "in use" in text.lower()]
    assert len(said) == 1 and said[0].startswith(line), out.stderr
    assert "Traceback" not in out.stderr and "RuntimeWarning" not in out.stderr, out.stderr
    assert "Application startup" not in out.stderr, out.stderr  # refused before it starts


@no_proxy
def test_a_metrics_port_in_use_leaves_no_coroutine_never_awaited() -> None:
    """The failed start of the --metrics-port listener left the tasks the app's start had
    begun to the loop's close (the model-list refresher, its connection half made, with
    --models-refresh on as by default): "RuntimeWarning: coroutine
    'connect_tcp.<locals>.try_connect' was never awaited" after the error."""
    port, out = serve_with_a_port_taken("--port", "0", "--metrics-port", "{port}")
    assert out.returncode == STARTUP_FAILURE, out.stderr
    assert f"--metrics-port {port}: cannot listen on 127.0.0.1:{port}" in out.stderr
    assert "never awaited" not in out.stderr and "Traceback" not in out.stderr, out.stderr
