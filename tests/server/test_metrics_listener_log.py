"""`tokenprobe serve --metrics-port`: the main server logs as it does without it.

The listener is a second uvicorn server in the process, on the same `uvicorn.error`
logger: a `log_level` of its own set that logger's level for both (its "warning" hid the
main server's start and shutdown lines), and its own lines would repeat the main one's."""

from __future__ import annotations

from tests.server.conftest import no_proxy
from tests.servers import free_port, metrics_port_taken, spawn, stop, wait_http


def serve_log(*flags: str) -> str:
    """The stderr of a `tokenprobe serve` started, answering, then stopped (SIGTERM)."""
    port = free_port()
    proxy = spawn(
        "serve", "--upstream", "http://127.0.0.1:9", "--port", str(port),
        "--models-refresh", "0", *flags,
    )  # fmt: skip
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz")
    finally:
        stop(proxy)
    _, err = proxy.communicate(timeout=10)
    return err.decode()


def lines_of(log: str) -> list[str]:
    """uvicorn's start and shutdown lines, in order (the process id and port left out)."""
    said = (
        "Started server process",
        "Waiting for application startup.",
        "Application startup complete.",
        "Uvicorn running on",
        "Shutting down",
        "Waiting for application shutdown.",
        "Application shutdown complete.",
        "Finished server process",
    )
    return [what for line in log.splitlines() for what in said if what in line]


@no_proxy
def test_the_main_server_logs_its_lines_once_and_the_listener_none() -> None:
    metrics_port = free_port()
    log = serve_log("--metrics-port", str(metrics_port))
    assert lines_of(log) == lines_of(serve_log()), log
    assert len(lines_of(log)) == 8, log  # each once: the listener repeats none of them
    assert f":{metrics_port}" not in log, log


@no_proxy
def test_what_the_listener_logs_says_it_is_the_listener_s() -> None:
    """Its bind failure (an error) is still logged, marked as its own."""
    _, out = metrics_port_taken()
    (line,) = [line for line in out.stderr.splitlines() if "Address already in use" in line]
    assert "--metrics-port listener: " in line, out.stderr
