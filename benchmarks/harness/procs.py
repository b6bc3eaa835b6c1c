"""The benchmark's processes: started pinned, stopped, and their CPU and memory read from /proc.

Every child is pinned with `os.sched_setaffinity` (the proxy under test on its own core,
the simulator and the load generator on the others), gets a high file-descriptor limit,
and dies with the benchmark (PR_SET_PDEATHSIG), so nothing outlives a crashed run.
CPU time is read from /proc: utime+stime of /proc/<pid>/stat (10 ms ticks, threads that
exited included) and the ns-resolution sum of /proc/<pid>/task/*/schedstat.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import checkout  # noqa: F401  (this checkout's proxy/ first)

BENCH = Path(__file__).resolve().parent.parent  # benchmarks/
ROOT = BENCH.parent
HARNESS = BENCH / "harness"
PEERS = BENCH / "peers"
PY = sys.executable
CLK_TCK = os.sysconf("SC_CLK_TCK")
#: The environment of a part run by path that imports other parts (the load generator's
#: `together` shape runs peers/sim_server.py in its own loop): this checkout, then benchmarks/.
PARTS_ENV = {"PYTHONPATH": os.pathsep.join((str(ROOT), str(BENCH)))}


def cores() -> tuple[set[int], set[int], set[int]]:
    """(proxy, simulator, load generator) cores: the proxy alone where there are two or more."""
    available = sorted(os.sched_getaffinity(0))
    if len(available) < 2:
        return set(available), set(available), set(available)
    proxy, rest = {available[0]}, available[1:]
    return proxy, {rest[0]}, {rest[-1]}


def _child_setup(cpus: set[int]) -> Callable[[], None]:
    def setup() -> None:
        os.sched_setaffinity(0, cpus)
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))
        with contextlib.suppress(OSError, AttributeError):  # die with the benchmark
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    return setup


def spawn(
    cmd: list[str],
    cpus: set[int],
    *,
    log: Path,
    env: dict[str, str] | None = None,
    stdout: Any = subprocess.DEVNULL,
    stdin: Any = subprocess.DEVNULL,
    tree: Path = ROOT,
) -> subprocess.Popen[Any]:
    full_env = {**os.environ, "PYTHONPATH": str(tree), **(env or {})}
    return subprocess.Popen(
        cmd,
        cwd=tree,
        env=full_env,
        stdin=stdin,
        stdout=stdout,
        stderr=log.open("ab"),
        preexec_fn=_child_setup(cpus),
    )


def stop(proc: subprocess.Popen[Any], timeout: float = 5.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


# -- /proc --------------------------------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    """pid and every live process below it."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


def cpu(pids: list[int]) -> tuple[int, int]:
    """(schedstat ns summed over live threads, stat utime+stime in ns) of these processes."""
    sched = ticks = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    sched += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return sched, ticks * 1_000_000_000 // CLK_TCK


def wakeups(pids: list[int]) -> int:
    """Voluntary context switches summed over these processes' live threads.

    For an event loop these are its sleeps in epoll_wait, each ended by a wakeup: relayed
    chunks over them say how many chunks one wakeup found waiting."""
    total = 0
    for pid in pids:
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/status") as f:
                    for line in f:
                        if line.startswith("voluntary_ctxt_switches:"):
                            total += int(line.split()[1])
        except (OSError, ValueError):
            continue
    return total


def system_busy_ns() -> int:
    """CPU time every core spent running processes (user, nice, system) or stolen by the
    hypervisor, from /proc/stat, in ns. Interrupt and softirq time is left out: the
    kernel's loopback networking for the benchmark's own traffic runs there (a fifth of
    the busy time in the emitter shape, 2026-12-05), and /proc/stat does not say on whose
    behalf, so counted as busy it read as other load in every phase."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, _irq, _softirq, steal = (
            int(x) for x in f.readline().split()[1:9]
        )
    return (user + nice + system + steal) * 1_000_000_000 // CLK_TCK


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


# -- readiness ------------------------------------------------------------------------------------


def probe(
    port: int,
    path: str = "/v1/chat/completions",
    timeout: float = 2.0,
    headers: dict[str, str] | None = None,
) -> bool:
    """One short non-streaming completion through `port`; True when it answers 200."""
    body = json.dumps({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(
            "POST",
            path,
            body,
            {
                "content-type": "application/json",
                "x-sim-output-tokens": "1",
                "x-sim-ttft": "0",
                **(headers or {}),
            },
        )
        response = conn.getresponse()
        response.read()
        return response.status == 200
    except OSError:
        return False
    finally:
        conn.close()


def wait_ready(
    proc: subprocess.Popen[Any],
    port: int,
    path: str,
    limit: float,
    headers: dict[str, str] | None = None,
) -> float:
    """Seconds from now until the first request through `port` succeeds."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before serving")
        if probe(port, path, timeout=1.0, headers=headers):
            return time.monotonic() - t0
        time.sleep(0.005)
    raise RuntimeError(f"nothing served on port {port} within {limit:.0f} s")


def workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="tokenprobe-bench-"))


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
