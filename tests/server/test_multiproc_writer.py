"""Who writes metrics to a PROMETHEUS_MULTIPROC_DIR now (proxy/server/multiproc.py): a
live writer refuses a second start on the directory, and a previous run's file whose pid
now belongs to some other live process does not. Writers are real processes: a proxy
started on the directory, a worker that built its exposition, an unrelated `sleep`."""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.server.multiproc import fresh_metrics_directory, writing_to
from proxy.settings import SettingsError
from tests.server.conftest import no_proxy, paths
from tests.servers import free_port, spawn, stop, wait_http

pytestmark = no_proxy

#: A process that takes the directory as `serve` does, or as a worker does (`worker`),
#: writes a counter there as a worker does, says so, and lives until its stdin closes.
_WRITER = """
import os, sys
directory, role = sys.argv[1], sys.argv[2]
os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
from prometheus_client import CollectorRegistry, Counter
from proxy.server.multiproc import fresh_metrics_directory, multiprocess_metrics_app
if role == "start":
    fresh_metrics_directory(directory)
else:
    multiprocess_metrics_app(directory)
Counter("worker_requests", "Requests.", registry=CollectorRegistry()).inc()
print("writing", flush=True)
sys.stdin.read()
"""

#: A previous run's files: prometheus-client's, a label ledger.
_PREVIOUS_RUN = ("gauge_livesum_999999999.db", "tokenprobe-admitted-team")


@pytest.fixture
def unrelated() -> Iterator[int]:
    """A live process that writes no metrics anywhere: the pid a dead worker's file names,
    reused."""
    process = subprocess.Popen(["sleep", "60"])
    try:
        yield process.pid
    finally:
        process.kill()
        process.wait()


def _writer(directory: Path, role: str) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(directory), role],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stdout.readline() == "writing\n"
    return process


def _end(process: subprocess.Popen[str]) -> None:
    assert process.stdin is not None
    process.stdin.close()
    assert process.wait(10) == 0


def test_a_previous_runs_file_whose_pid_another_process_has_now_does_not_refuse_the_start(
    tmp_path: Path, unrelated: int
) -> None:
    """A dead worker's file names a pid some unrelated process has now (a restarted
    container numbers its processes from 1 again): `os.kill(pid, 0)` found it alive and
    the start was refused, for as long as that process lived."""
    for name in (f"counter_{unrelated}.db", *_PREVIOUS_RUN):
        (tmp_path / name).write_text("x")
    fresh_metrics_directory(str(tmp_path))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("role", ["start", "worker"])
def test_a_live_writer_refuses_the_start_named_and_untouched(tmp_path: Path, role: str) -> None:
    """Another proxy on the directory (`start`), or a worker that outlived its parent
    (`worker`): clearing would send their counters back to 0. Once it ends, however it
    ends, the directory is free again."""
    for name in _PREVIOUS_RUN:
        (tmp_path / name).write_text("x")
    writer = _writer(tmp_path, role)
    files = sorted(os.listdir(tmp_path))
    try:
        with pytest.raises(SettingsError, match=rf"_DIR=.*: process {writer.pid} is writing"):
            fresh_metrics_directory(str(tmp_path))
        assert sorted(os.listdir(tmp_path)) == files
        with pytest.raises(SettingsError):  # refused again: a refusal keeps nothing held
            fresh_metrics_directory(str(tmp_path))
    finally:
        _end(writer)
    fresh_metrics_directory(str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_a_process_that_holds_the_directory_is_not_refused_by_itself(tmp_path: Path) -> None:
    """One process in multiprocess mode starts on the directory, then builds its
    exposition (a worker's way in): the second must not wait on the first's hold."""
    script = (
        "import sys\n"
        "from proxy.server.multiproc import fresh_metrics_directory, multiprocess_metrics_app\n"
        "fresh_metrics_directory(sys.argv[1])\n"
        "multiprocess_metrics_app(sys.argv[1])\n"
        "fresh_metrics_directory(sys.argv[1])\n"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, timeout=20)


@paths("wire", why="the metrics directory is the process's, whichever relay it runs")
def test_serve_with_workers_starts_on_a_stale_file_of_a_live_pid_and_refuses_a_second_serve(
    tmp_path: Path, unrelated: int
) -> None:
    """`tokenprobe serve --workers 2` end to end: a stale file naming a live unrelated
    process is cleared, not a refusal; a second serve on the directory is refused while
    the first runs, with exit status 2."""
    directory = tmp_path / "metrics"
    directory.mkdir()
    (directory / f"counter_{unrelated}.db").write_text("x")
    env = {"PROMETHEUS_MULTIPROC_DIR": str(directory)}
    port = free_port()
    first = spawn(
        "serve", "--upstream", "http://127.0.0.1:9", "--port", str(port), "--workers", "2",
        "--access-log", "off", env=env,
    )  # fmt: skip
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz")
        assert f"counter_{unrelated}.db" not in os.listdir(directory)
        second = subprocess.run(
            [sys.executable, "-m", "proxy", "serve", "--upstream", "http://127.0.0.1:9",
             "--port", "0", "--workers", "2"],
            env={**os.environ, **env}, capture_output=True, text=True, timeout=20,
        )  # fmt: skip
        assert second.returncode == 2, second.stderr
        assert f"PROMETHEUS_MULTIPROC_DIR={str(directory)!r}: process " in second.stderr
    finally:
        stop(first)


def test_a_filesystem_without_flock_starts_unguarded_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Some network filesystems have no flock (ENOLCK): the start goes on as it did before
    the check, clears the previous run's files, and says the directory is unguarded."""

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    for name in _PREVIOUS_RUN:
        (tmp_path / name).write_text("x")
    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level("WARNING", logger="tokenprobe"):
        fresh_metrics_directory(str(tmp_path))
        writing_to(str(tmp_path))  # a worker's hold: nothing to hold, no error
    assert os.listdir(tmp_path) == []
    assert "cannot lock it (No locks available)" in caplog.text
