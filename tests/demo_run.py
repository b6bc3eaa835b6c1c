"""One `tokenprobe demo --rounds 1` for every test of a run that reads its table.

The demo sends its 29 requests one after the other: about 15 s, 1.4 s of it CPU. Two
modules check rows of the same table (tests/server/test_apis_more_e2e.py, the new APIs;
tests/server/test_ollama_e2e.py, the Ollama and llama.cpp rows), and each ran it: a
worker waited 15 s twice a run. In a parallel run the first pytest process starts it as
soon as a worker has collected either module (tests/conftest.py, `EARLY`), and both tests
read its output when they come to it, a minute or more later. Elsewhere (a serial run)
the first test to ask runs it and leaves its output in the run's temporary folder for
the other. Each test still asserts on the run's exit status.

The demo runs its proxy on the wire whatever TOKENPROBE_RELAY says (proxy/demo.py builds
its own Settings), so one run serves both data paths' tests.
"""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.run_folder import run_folder
from tests.servers import Started, started_early, wait_early

COMMAND = ("-m", "proxy", "demo", "--port", "0", "--rounds", "1")
#: Seconds the demo may take from its start.
TIMEOUT = 120


def start_demo(folder: Path) -> Started | None:
    """The demo, started early by the first pytest process of a parallel run, in a process
    group of its own; once, though both modules name it (the second finds its folder)."""
    if folder.exists():
        return None
    folder.mkdir(parents=True)
    with (folder / "stdout").open("wb") as stdout, (folder / "stderr").open("wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, *COMMAND],
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            process_group=0,
        )
    return [process], {"out": str(folder), "deadline": time.time() + TIMEOUT}


def demo_run(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    """The demo's exit status and output: the early run's, or one run for this test run."""
    early = started_early(start_demo)
    if early is None:
        return _once(run_folder(tmp_path_factory) / "demo.json")
    out, returncode = wait_early(early)
    read = {name: (out / name).read_text(errors="replace") for name in ("stdout", "stderr")}
    return subprocess.CompletedProcess(COMMAND, returncode, read["stdout"], read["stderr"])


def _once(cached: Path) -> subprocess.CompletedProcess[str]:
    with open(cached.with_suffix(".lock"), "ab") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released with the file
        if cached.exists():
            saved = json.loads(cached.read_text())
            return subprocess.CompletedProcess(COMMAND, saved["rc"], saved["out"], saved["err"])
        run = subprocess.run(
            [sys.executable, *COMMAND], capture_output=True, text=True, timeout=TIMEOUT
        )
        # written whole before the lock goes: a reader never sees half a file
        cached.write_text(json.dumps({"rc": run.returncode, "out": run.stdout, "err": run.stderr}))
        return run
