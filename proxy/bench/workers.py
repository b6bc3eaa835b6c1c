"""`--workers N`: one run on N processes of this machine, on one clock, merged into one file.

Each worker is the same command with `--shard I/N` (its share of the streams or of the
requests) and a hidden `--sync`: it prepares everything, says `ready` on stdout, and
waits for the start instant on stdin. The parent sends every worker the same
`perf_counter()` instant (CLOCK_MONOTONIC: one clock for every process of a Linux
machine) once all are ready, so every schedule starts together; then it merges the
workers' run files (merge.py) exactly as `tokenprobe bench merge` does.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from time import perf_counter
from typing import Any

from proxy.bench.merge import MergeError, merge, read

#: Flags of the parent that its workers do not get (each gets its own).
_DROPPED = {"--workers": 1, "--out": 1, "--quiet": 0, "--shard": 1, "--plot": 1, "--start-at": 1}
#: Seconds between "all ready" and the shared start: time for the start line to arrive.
LEAD = 0.05


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
    """Run `python -m proxy.bench COMMAND ARGV` on `count` workers; the merged run document."""
    with tempfile.TemporaryDirectory(prefix="tokenprobe-workers-") as tmp:
        paths = [str(Path(tmp) / f"shard{i}.json") for i in range(count)]
        base = [sys.executable, "-m", "proxy.bench", *command, *child_argv(argv)]
        pipe = subprocess.PIPE
        procs = [
            subprocess.Popen(
                [*base, "--shard", f"{i}/{count}", "--out", path, "--quiet", "--sync"],
                stdin=pipe,
                stdout=pipe,
                stderr=pipe,
            )
            for i, path in enumerate(paths)
        ]
        try:
            for i, proc in enumerate(procs):
                assert proc.stdout is not None
                if proc.stdout.readline().strip() != b"ready":
                    raise WorkerError(f"worker {i} failed before the start: {_stderr(proc)}")
            start = perf_counter() + LEAD
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.write(f"{start!r}\n".encode())
                proc.stdin.flush()
            for proc in procs:
                proc.communicate()
        except BaseException:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            raise
        missing = [i for i, path in enumerate(paths) if not Path(path).exists()]
        if missing:
            raise WorkerError(f"worker {missing[0]} wrote no run file")
        try:
            return merge([read(path) for path in paths], paths)
        except MergeError as exc:
            raise WorkerError(str(exc)) from None


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
