"""`tokenprobe serve` as a real process stopped by a signal, and refused a port in use.

Ctrl-C in a terminal sends SIGINT to the whole foreground process group: the server and,
with --workers, every worker. The processes here lead a group of their own, and the
signal goes to the group, as the terminal sends it."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from uvicorn.config import STARTUP_FAILURE

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


def stopped_by(sig: signal.Signals, workers: int) -> tuple[int, str]:
    """A `tokenprobe serve` with `workers` processes started, every one of them serving,
    then sent `sig` to its process group: its exit status and its stderr.

    /healthz answers once one worker serves; a worker still starting when the signal comes
    stops otherwise (a worker still importing raises KeyboardInterrupt in multiprocessing's
    start-up), so the log is read until each has said it started."""
    port = free_port()
    proxy = spawn(
        "serve", "--upstream", "http://127.0.0.1:9", "--port", str(port),
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
        os.killpg(proxy.pid, sig)
        proxy.wait(60)  # a drain with nothing in flight: about a second
    finally:
        stop_group(proxy)
        reader.join(10)
    return proxy.returncode, "".join(lines)


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
