"""`tokenprobe serve --workers N`: every worker runs the settings the parent resolved, logs
as it was told, and a start that cannot succeed ends once, with a non-zero status, where
the workers were started again and again."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import typing
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
from uvicorn.config import STARTUP_FAILURE

from proxy.server.serve import WorkerApp, uvicorn_options, worker_config
from proxy.settings import SPECS, Settings
from tests.server.conftest import no_proxy, paths
from tests.servers import free_port, spawn, stop, wait_http

UPSTREAM = "http://127.0.0.1:9"
#: The settings that may be None: each a setting turned off, or not given.
OPTIONAL = [
    spec.name
    for spec in SPECS
    if type(None) in typing.get_args(typing.get_type_hints(Settings)[spec.name])
]


def handed_over(settings: Settings) -> Settings:
    """The settings a worker runs: the workers' uvicorn configuration pickled as
    multiprocessing's spawn pickles it into each worker process, and read back there."""
    config = ForkingPickler.loads(ForkingPickler.dumps(worker_config(settings, {})))
    assert isinstance(config.app, WorkerApp)
    return config.app.settings


@no_proxy
@pytest.mark.parametrize("name", OPTIONAL)
def test_a_setting_turned_off_reaches_every_worker_off(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """None (`--header-timeout 0`, `--models-refresh 0`, or not given) had no text to hand
    over as TOKENPROBE_*, so a worker read the default or a stale variable instead."""
    spec = next(spec for spec in SPECS if spec.name == name)
    monkeypatch.setenv(spec.env, "stale")  # a variable the parent's flag overrode
    settings = Settings(upstream=UPSTREAM, **{name: None})
    assert handed_over(settings) == settings


@no_proxy
def test_a_worker_runs_exactly_the_settings_the_parent_resolved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = Settings(
        upstream=UPSTREAM,
        header_timeout=None,
        models_refresh=None,
        label_header=("x-team=team", "x-app=app"),
        key_label="hash",
        key_salt="drawn-once",
        workers=2,
    )
    monkeypatch.setenv("TOKENPROBE_HEADER_TIMEOUT", "2")
    monkeypatch.setenv("TOKENPROBE_WORKERS", "5")
    assert handed_over(settings) == settings
    assert uvicorn_options(handed_over(settings))["loop"].args == (None,)  # its TLS handshake


@no_proxy
def test_a_worker_that_cannot_build_its_app_says_why_once_and_fails_its_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """uvicorn's supervisor stops the server for a worker that exits with STARTUP_FAILURE;
    an exception from the factory was a crash, and the worker was started again, forever."""
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "bogus")
    with pytest.raises(SystemExit) as exited:
        WorkerApp(Settings(upstream=UPSTREAM))()
    assert exited.value.code == STARTUP_FAILURE
    err = capsys.readouterr().err
    assert err == (
        "tokenprobe serve: OTEL_METRICS_EXPORTER='bogus': expected otlp, console, "
        "prometheus or none\n"
    )


@no_proxy
def test_a_bad_otel_variable_refuses_a_start_with_workers_at_once_in_one_line() -> None:
    """Refused by the parent, as one process refuses it, before any worker starts."""
    proxy = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--upstream", UPSTREAM, "--port", "0",
         "--workers", "2", "--access-log", "off"],
        env={**os.environ, "OTEL_METRICS_EXPORTER": "bogus"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its workers too are stopped if it never ends
    )  # fmt: skip
    try:
        _, err = proxy.communicate(timeout=10)
    finally:
        if proxy.poll() is None:
            os.killpg(proxy.pid, signal.SIGKILL)
            proxy.wait()
    assert proxy.returncode == 2, err
    assert err.count("OTEL_METRICS_EXPORTER='bogus'") == 1 and "Traceback" not in err, err


# -- two workers serving, against the simulator ------------------------------------------

WHY = "the hand-over to workers is the same whichever relay they run"


@pytest.fixture(scope="module")
def workers(relay: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """`--workers 2 --log-level info --header-timeout 0`, with a stale
    TOKENPROBE_HEADER_TIMEOUT the flag overrides: its port and its stderr."""
    sim_port, port = free_port(), free_port()
    sim = spawn("sim", "--port", str(sim_port), "--log-level", "warning")
    log = tmp_path_factory.mktemp("workers") / "stderr.log"
    with log.open("wb") as err:
        proxy = spawn(
            "serve", "--upstream", f"http://127.0.0.1:{sim_port}", "--port", str(port),
            "--workers", "2", "--log-level", "info", "--header-timeout", "0",
            "--access-log", "off", env={"TOKENPROBE_HEADER_TIMEOUT": "0.2"}, stderr=err,
        )  # fmt: skip
    try:
        wait_http(f"http://127.0.0.1:{sim_port}/health")
        wait_http(f"http://127.0.0.1:{port}/healthz")
        yield port, log
    finally:
        stop(proxy)
        stop(sim)


@paths("wire", why=WHY)
def test_workers_log_at_the_level_asked(workers: tuple[int, Path]) -> None:
    """Logging was set up in the parent only: a worker dropped the `tokenprobe` logger's
    INFO lines and printed its warnings unformatted whatever --log-level said."""
    _, log = workers
    deadline = time.monotonic() + 10
    while "INFO tokenprobe: upstream backend:" not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


@paths("wire", why=WHY)
def test_a_timeout_turned_off_stays_off_in_the_workers(workers: tuple[int, Path]) -> None:
    """`--header-timeout 0` over TOKENPROBE_HEADER_TIMEOUT=0.2: a head still arriving is
    not cut (the workers read the variable: 408 after 0.2 s)."""
    port, _ = workers
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # the head never ends
        client.settimeout(1.0)
        with pytest.raises(TimeoutError):
            client.recv(100)
