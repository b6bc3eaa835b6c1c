"""proxy/server/multiproc.py: a dead worker's in-flight requests, read from its metric
file, counted once, and neither a file it died writing nor one a worker is creating
breaks a scrape; the directory a start clears (the one it refuses:
tests/server/test_multiproc_writer.py)."""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.server.multiproc import (
    drop_dead_workers,
    fresh_metrics_directory,
    multiprocess_metrics_app,
)
from tests.scrape import Scrape
from tests.server.conftest import no_proxy

pytestmark = no_proxy

#: A process writes a value of the in-flight gauge, as a worker does, and exits.
_WORKER = """
import os, sys
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
from prometheus_client import CollectorRegistry
from proxy.sinks.metrics import Metrics
metrics = Metrics(CollectorRegistry())
metrics.in_flight.labels("llama", "/v1/chat/completions").inc(3)
metrics.in_flight.labels("qwen", "/v1/completions").inc(1)
metrics.in_flight.labels("qwen", "/v1/completions").dec(1)
"""


def test_a_dead_workers_requests_in_flight_are_counted_once(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-c", _WORKER, str(tmp_path)], check=True)
    assert any(name.startswith("gauge_livesum_") for name in os.listdir(tmp_path))
    lost: list[tuple[str, str, float]] = []
    drop_dead_workers(str(tmp_path), lambda *found: lost.append(found))
    drop_dead_workers(str(tmp_path), lambda *found: lost.append(found))  # the next scrape
    assert lost == [("llama", "/v1/chat/completions", 3.0)]  # none for a request that ended
    assert not [name for name in os.listdir(tmp_path) if name.startswith("gauge_live")]


#: A worker as `serve --workers` runs one: it builds its exposition (its live mark), writes
#: an in-flight value, says so, and lives until its stdin closes.
_LIVING_WORKER = """
import os, sys
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
from prometheus_client import CollectorRegistry
from proxy.server.multiproc import multiprocess_metrics_app
from proxy.sinks.metrics import Metrics
multiprocess_metrics_app(sys.argv[1])
Metrics(CollectorRegistry()).in_flight.labels("llama", "/v1/chat/completions").inc(2)
print("writing", flush=True)
sys.stdin.read()
"""


def test_a_dead_workers_pid_taken_by_another_process_does_not_keep_its_requests_in_flight(
    tmp_path: Path,
) -> None:
    """A worker died and another process got its pid (a restarted container numbers its
    processes from 1 again): `os.kill(pid, 0)` found that one alive, so the dead worker's
    in-flight requests stayed in tokenprobe_requests_in_flight for as long as it lived.
    Its live mark, which no one holds any more, says it ended; a living worker's does not."""
    living, ended = (_start(_LIVING_WORKER, tmp_path) for _ in range(2))
    other = subprocess.Popen(["sleep", "60"])  # the pid the ended worker's files name now
    try:
        _stop(ended)
        for name in os.listdir(tmp_path):  # as if `other` had taken the ended one's pid
            if name.endswith((f"_{ended.pid}.db", f"-live-{ended.pid}")):
                os.rename(tmp_path / name, tmp_path / name.replace(str(ended.pid), str(other.pid)))
        lost: list[tuple[str, str, float]] = []
        drop_dead_workers(str(tmp_path), lambda *found: lost.append(found))
        assert lost == [("llama", "/v1/chat/completions", 2.0)]  # the ended one's, once
        live = sorted(name for name in os.listdir(tmp_path) if "live" in name)
        assert live == [f"gauge_livesum_{living.pid}.db", f"tokenprobe-live-{living.pid}"]
    finally:
        other.kill()
        other.wait()
        _stop(living)


def _start(script: str, directory: Path) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", script, str(directory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stdout.readline() == "writing\n"
    return process


def _stop(process: subprocess.Popen[str]) -> None:
    assert process.stdin is not None
    process.stdin.close()
    assert process.wait(10) == 0


def test_a_dead_workers_open_websocket_sessions_are_counted_apart_from_its_requests(
    tmp_path: Path,
) -> None:
    worker = _WORKER + 'metrics.ws.in_flight.labels("/v1/realtime").inc(2)\n'
    subprocess.run([sys.executable, "-c", worker, str(tmp_path)], check=True)
    requests: list[tuple[str, str, float]] = []
    sessions: list[tuple[str, float]] = []
    for _ in range(2):  # this scrape, and the next
        drop_dead_workers(
            str(tmp_path),
            lambda *found: requests.append(found),
            lambda *found: sessions.append(found),
        )
    assert requests == [("llama", "/v1/chat/completions", 3.0)]
    assert sessions == [("/v1/realtime", 2.0)]


def test_a_file_the_worker_died_writing_is_dropped_and_the_scrape_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "gauge_livesum_999999999.db").write_bytes(b"garbage")
    lost: list[tuple[str, str, float]] = []
    drop_dead_workers(str(tmp_path), lambda *found: lost.append(found))
    assert lost == [] and os.listdir(tmp_path) == []
    assert "dead worker" in caplog.text


def test_two_workers_dropping_the_same_dead_workers_at_once_both_go_on(tmp_path: Path) -> None:
    """Two workers answering scrapes at the same moment both remove the dead workers' live
    gauge files: a file the other removed first is gone, not an error (prometheus-client's
    mark_process_dead raised FileNotFoundError, and that scrape answered 500)."""
    import threading

    subprocess.run([sys.executable, "-c", _WORKER, str(tmp_path)], check=True)
    (real,) = [p for p in tmp_path.iterdir() if p.name.startswith("gauge_livesum_")]
    for pid in range(999_000_000, 999_000_800):  # no such processes: dead workers' files
        (tmp_path / f"gauge_livemax_{pid}.db").write_bytes(real.read_bytes())
    start, failed = threading.Barrier(2), []

    def scrape() -> None:
        start.wait()
        try:
            drop_dead_workers(str(tmp_path), lambda *found: None)
        except Exception as exc:  # what the scrape would have answered 500 for
            failed.append(exc)

    threads = [threading.Thread(target=scrape) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failed == []
    assert not [name for name in os.listdir(tmp_path) if name.startswith("gauge_live")]


#: A worker's counter, written to its file as a worker writes it.
_COUNTS = """
import os, sys
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
from prometheus_client import CollectorRegistry, Counter
Counter("worker_requests", "Requests.", registry=CollectorRegistry()).inc(2)
"""


def test_a_file_a_worker_is_creating_is_read_as_holding_nothing_yet(tmp_path: Path) -> None:
    """A worker opens a new metric file, then sizes it: a scrape between the two finds
    it empty (prometheus-client's reader took it for a corrupt file: the scrape was a
    500). Here a live process's file stays in that state while the scrape runs."""
    subprocess.run([sys.executable, "-c", _COUNTS, str(tmp_path)], check=True)
    (tmp_path / f"histogram_{os.getpid()}.db").touch()

    async def scrape() -> httpx.Response:
        transport = httpx.ASGITransport(app=multiprocess_metrics_app(str(tmp_path)))
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            return await client.get("/metrics")

    page = asyncio.run(scrape())
    assert page.status_code == 200, page.text
    assert Scrape.parse(page.text).total("worker_requests_total") == 2


#: A previous run's files in the metrics directory: prometheus-client's (dead writers),
#: a dead worker's file claimed while a scrape counted it, and a label ledger.
_PREVIOUS_RUN = (
    "counter_999999999.db",
    "gauge_livesum_999999999.db",
    "gauge_livesum_999999998.db.999999997.claimed",
    "tokenprobe-admitted-team",
    "tokenprobe-live-999999999",
)


def test_a_start_clears_a_previous_runs_files_and_keeps_the_directory_and_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mount point (a Kubernetes emptyDir) cannot be removed: the directory was removed
    with everything in it, then made again, which failed ("File exists") and stopped the
    start, another application's files gone. Here it cannot be removed either."""
    directory = tmp_path / "metrics"
    directory.mkdir()
    foreign = ["app.db", "notes.txt", "counter.db"]
    for name in (*_PREVIOUS_RUN, *foreign):
        (directory / name).write_text("x")
    rmdir = os.rmdir

    def mount_point(path: str, *args: Any, **kwargs: Any) -> None:
        if os.fspath(path) == str(directory):
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), path)
        rmdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "rmdir", mount_point)
    fresh_metrics_directory(str(directory))
    assert sorted(os.listdir(directory)) == sorted(foreign)


def test_this_processs_own_files_and_dead_ones_do_not_refuse_the_start(tmp_path: Path) -> None:
    for name in (f"counter_{os.getpid()}.db", *_PREVIOUS_RUN):
        (tmp_path / name).write_text("x")
    fresh_metrics_directory(str(tmp_path / "."))
    assert os.listdir(tmp_path) == []
    fresh_metrics_directory(str(tmp_path / "made" / "here"))
    assert (tmp_path / "made" / "here").is_dir()
