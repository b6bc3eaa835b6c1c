"""`--workers N`: one run on N processes of this machine, on one clock, merged into one file.

Each worker is the same command with `--shard I/N` (its share of the streams or of the
requests) and a hidden `--sync`: it prepares everything, says `ready` on stdout, and
waits for the start instant on stdin. The parent sends every worker the same
`perf_counter()` instant (CLOCK_MONOTONIC: one clock for every process of a Linux
machine) once all are ready, so every schedule starts together; then it merges the
workers' run files (merge.py) exactly as `tokenprobe bench merge` does.

Ctrl-C or SIGTERM stops the run as it stops one process: each worker gets one SIGINT,
writes what it measured and exits, and the parent merges those files into a run marked
interrupted. The workers run in a process group of their own, so that a terminal's
Ctrl-C reaches them once, through the parent, never twice (a second SIGINT that lands
after a worker's run has ended interrupts the writing of its file); the parent passes a
closed terminal's SIGHUP on the same way, and a worker gets SIGINT when its parent dies
(Linux's PR_SET_PDEATHSIG), so none outlives it loading the backend.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from time import monotonic, perf_counter
from types import FrameType
from typing import Any

from proxy.bench.merge import MergeError, merge, read

#: Flags of the parent that its workers do not get (each gets its own).
#: --compare-metrics is the parent's: it scrapes once around the whole run.
_DROPPED = {
    "--workers": 1, "--out": 1, "--quiet": 0, "--shard": 1, "--plot": 1, "--start-at": 1,
    "--compare-metrics": 1,
}  # fmt: skip
#: Seconds between "all ready" and the shared start: time for the start line to arrive.
LEAD = 0.05
#: Seconds the workers get, after an interrupt, to write what they measured before they
#: are killed (a worker writes its file within a second of its SIGINT).
GRACE = 10.0
#: How often the parent, waiting for its workers, looks whether their GRACE is over.
_POLL = 0.2


class WorkerError(RuntimeError):
    """A worker failed before the run began or left no run file; the message says which."""


def child_argv(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    skip = 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in _DROPPED:
            skip = _DROPPED[name] if "=" not in arg else 0
            continue
        out.append(arg)
    return out


def run(command: Sequence[str], argv: Sequence[str], count: int) -> dict[str, Any]:
    """Run `python -m proxy.bench COMMAND ARGV` on `count` workers; the merged run document.

    Interrupted after the start, the merged document of what the workers wrote, with
    status "interrupted"; interrupted before it (nothing measured), KeyboardInterrupt."""
    with (
        tempfile.TemporaryDirectory(prefix="tokenprobe-workers-") as tmp,
        _stops() as stop,
    ):
        paths = [str(Path(tmp) / f"shard{i}.json") for i in range(count)]
        base = [sys.executable, "-m", "proxy.bench", *command, *child_argv(argv)]
        pipe = subprocess.PIPE
        for i, path in enumerate(paths):
            stop.workers.append(
                subprocess.Popen(
                    [*base, "--shard", f"{i}/{count}", "--out", path, "--quiet", "--sync"],
                    stdin=pipe,
                    stdout=pipe,
                    stderr=pipe,
                    process_group=0,
                    preexec_fn=_die_with_parent,
                )
            )
        procs = stop.workers
        try:
            for i, proc in enumerate(procs):
                assert proc.stdout is not None
                ready = proc.stdout.readline().strip() == b"ready"
                if stop.since is not None:  # before the start: nothing was measured
                    raise KeyboardInterrupt
                if not ready:
                    raise WorkerError(f"worker {i} failed before the start: {_stderr(proc)}")
            start = perf_counter() + LEAD
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.write(f"{start!r}\n".encode())
                proc.stdin.flush()
            for proc in procs:
                _wait(proc, stop)
        except BaseException:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            raise
        written = [path for path in paths if Path(path).exists()]
        missing = [i for i, path in enumerate(paths) if path not in written]
        if stop.since is None and missing:
            raise WorkerError(f"worker {missing[0]} wrote no run file")
        if not written:
            raise KeyboardInterrupt
        try:
            doc = merge([read(path) for path in written], written)
        except MergeError as exc:
            raise WorkerError(str(exc)) from None
        if stop.since is not None:
            doc["status"] = "interrupted"
            if missing and not doc.get("problem"):
                doc["problem"] = (
                    f"interrupted: worker {missing[0]} wrote no run file; the merged run "
                    f"holds {len(written)} of {count} shares"
                )
        return doc


def _die_with_parent() -> None:
    """In a worker before it runs (Linux): SIGINT when its parent dies (PR_SET_PDEATHSIG),
    so a parent killed outright (SIGKILL, its own crash) leaves no worker loading the
    backend until its run ends; it writes what it measured and exits, as on Ctrl-C."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGINT, 0, 0, 0)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class _Stop:
    """The parent's SIGINT, SIGTERM and SIGHUP: the first is passed on to every worker as
    SIGINT."""

    def __init__(self) -> None:
        self.workers: list[subprocess.Popen[bytes]] = []
        self.since: float | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.since is not None:
            return
        self.since = monotonic()
        for proc in self.workers:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGINT)

    def over(self) -> bool:
        """Whether the workers' GRACE after an interrupt has run out."""
        return self.since is not None and monotonic() - self.since >= GRACE


@contextlib.contextmanager
def _stops() -> Iterator[_Stop]:
    stop = _Stop()
    # a closed terminal's SIGHUP too: in process groups of their own, the workers hear
    # nothing of their terminal (a dropped ssh session left them loading the backend)
    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    try:
        before = [signal.signal(signum, stop) for signum in handled]
    except ValueError:  # not the main thread: signals are not this run's to handle
        yield stop
        return
    try:
        yield stop
    finally:
        for signum, handler in zip(handled, before, strict=True):
            signal.signal(signum, handler)


def _wait(proc: subprocess.Popen[bytes], stop: _Stop) -> None:
    """Wait for a worker (draining its pipes); killed when an interrupt's GRACE is over."""
    while True:
        try:
            proc.communicate(timeout=_POLL)
            return
        except subprocess.TimeoutExpired:
            if stop.over():
                proc.kill()


def _stderr(proc: subprocess.Popen[bytes]) -> str:
    proc.wait()
    assert proc.stderr is not None
    text = proc.stderr.read().decode(errors="replace").strip().splitlines()
    return text[-1] if text else f"exit status {proc.returncode}"


def at_wall_clock(unix: float) -> float:
    """`--start-at UNIX`: that wall-clock instant as a perf_counter() instant (shards on
    several machines start one schedule together, as far as their clocks agree)."""
    from time import time

    return perf_counter() + max(0.0, unix - time())


def wait_for_start() -> float:
    """In a worker: say ready, and read the shared start instant."""
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    return float(sys.stdin.readline())
