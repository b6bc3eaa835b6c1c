"""Shared fixtures: the simulator and the proxy, each on real uvicorn on loopback."""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from prometheus_client import CollectorRegistry

from proxy.bench.ports import RANGE_ENV, below_ephemeral
from proxy.core.measurement import Measurement
from proxy.server.app import ProxyApp
from proxy.server.assemble import assemble
from proxy.settings import Settings
from proxy.sim.app import SimApp, create_sim_app
from proxy.sim.config import SimConfig
from proxy.sinks.sink import Recorder, Sink
from tests import alone, bytecode
from tests.servers import (
    EARLY_ENV,
    Early,
    ThreadedHypercorn,
    ThreadedServer,
    share_the_default_trust,
)

MODEL = "sim-model"

# No per-example deadline: a property test checks what the code does, and an example's
# wall time on two shared cores says more about the other workers than about the code
# (one took 328 ms against the default 200 ms in a parallel run, 0.1 ms on its rerun).
settings.register_profile("tokenprobe", deadline=None)
settings.load_profile("tokenprobe")

bytecode.keep_outside_the_tree()
share_the_default_trust()  # httpx.get and the others: one TLS trust, not one a call

#: The most workers `-n auto` starts (pyproject.toml's addopts): each runs servers of its own.
MAX_WORKERS = 8


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """Two workers a core: most tests wait on sockets, servers and subprocesses, not the
    CPU (the whole suite uses about half the CPU time it takes in wall time, serially).
    Each module runs whole on one worker (--dist loadscope), so a module fixture (a vLLM,
    a benchmark run, a Prometheus) starts once, as it does serially. And one more worker
    for the modules that mostly wait (`WAITING`), which runs nothing else."""
    return active_workers() + 1


def active_workers() -> int:
    """The workers that run any module: two a core, at most `MAX_WORKERS`."""
    return min(MAX_WORKERS, 2 * (os.cpu_count() or 1))


#: The modules that mostly wait: for the proxy's timeouts against a hostile peer, a slow
#: client or upstream (about a sixth of a core each, one and a half to two minutes apiece
#: beside the other workers). The worker beyond the active ones (`active_workers`) runs
#: them one after the other, and the active workers the rest (tests/alone.py, `AloneLast`):
#: 230 s of a 290 s rest that four workers shared, for a sixth of a core more beside them.
#: A module listed here that starts using the CPU makes that worker a fifth active one.
WAITING = (
    "tests/hostile/test_upstream.py",
    "tests/hostile/test_client.py",
    # a fifth of a core each (2.7 s of CPU in 12.7 s, 1.8 s in 10.9 s, run alone): the
    # worker that waits had 170 s left over once the two above shared their proxies well
    "tests/hostile/test_tunnel.py",
    "tests/hostile/test_framing.py",
    # each of their tests waited out a second of silence (`exchange(..., idle=1.0)`): 46
    # and 38 s run alone, nearly all of it waiting; listed nowhere, they ran last on the
    # active workers, and the pure pass took 404 s where it had taken 359. Their
    # exchanges now end once the answers are whole: 18 and 16 s, a third of a core each
    "tests/hostile/test_upstream_heads.py",
    "tests/hostile/test_upstream_more.py",
)


#: About how many seconds each module's tests take on a worker of a parallel run on 2 cores,
#: fixtures included (measured 2026-12-07 beside other work, which made them all longer; the
#: modules of 5 s or more). A parallel run hands out the modules in this order, longest
#: first, each to the next worker that runs low, so that the run ends with short modules on
#: every worker rather than with one worker in a long one while the others wait: the alone
#: and quiet tests (tests/alone.py) wait for the rest to end. Collected in file order, the
#: rest once ended with a 45 s module handed out when the others had 15 s left, and three
#: workers waited 13-19 s each. A module not listed is taken to be shorter, and keeps its
#: place among those; a wrong figure costs time, never a test. A module started early
#: (`EARLY`) counts its tests only, or less: its process needs the time of the modules
#: before it to start.
SECONDS = {
    # measured 2026-12-07 in a run beside three busy loops (fewer proxy scrapes since)
    "tests/hostile/test_client.py": 139,
    "tests/hostile/test_upstream.py": 94,
    "tests/server/test_serve.py": 124,
    # 168 s before its records shared one event loop (half the time, run alone: 52.6 to 26.2 s)
    "tests/core/test_fast_facts.py": 84,
    "tests/server/test_ui.py": 75,
    "tests/test_docs_commands.py": 67,
    "tests/server/test_load.py": 47,
    "tests/deploy/test_grafana_live.py": 47,
    "tests/server/test_reasoning_e2e.py": 47,
    "tests/sinks/test_otlp_metrics_e2e.py": 45,
    "tests/server/test_proxy_e2e.py": 45,
    "tests/server/test_apis_e2e.py": 40,
    "tests/server/test_websockets.py": 38,
    "tests/server/test_apis_more_e2e.py": 22,  # 37 with its own demo (now started early)
    "tests/server/test_ttft_split_e2e.py": 36,
    "tests/server/test_open_files.py": 35,
    "tests/server/test_ollama_e2e.py": 16,  # 31 with its own demo, as above
    "tests/server/test_apis_sim_e2e.py": 30,
    "tests/bench/test_replay.py": 26,
    "tests/llamacpp/test_real_llamacpp.py": 25,
    "tests/hostile/test_tunnel.py": 24,
    "tests/server/test_slo_e2e.py": 23,
    # added 2026-12-07, measured run alone (-n0)
    "tests/hostile/test_upstream_heads.py": 18,  # 46 while each exchange waited 1 s idle
    "tests/hostile/test_upstream_more.py": 16,  # 38, as above
    "tests/server/test_ws_arrival.py": 11,
    "tests/server/test_conversation_id_usage.py": 10,
    "tests/server/test_invocations_e2e.py": 7,
    "tests/hostile/test_upstream_faults.py": 22,
    "tests/deploy/test_outage_alert_live.py": 10,
    "tests/hostile/test_body_cut_words.py": 8,
    "tests/server/test_held_chunks_e2e.py": 5,
    "tests/server/test_background_responses_e2e.py": 12,  # 7.7 s alone (-n0) since its retrievals
    # 23 s alone (-n0), 2026-12-07: refused requests' turns added
    "tests/server/test_conversations_e2e.py": 30,
    "tests/hostile/test_in_stream_errors.py": 5,
    # 40 s of tests, listed lower: handed out when its vLLMs, started early and loading
    # below the tests' priority, are up (2.5 minutes; at 2 it waited 40 s). At 23 its
    # setup still waited 48 s (2026-12-07, more modules before it): later again
    "tests/vllm/test_real_vllm.py": 12,
    "tests/server/test_tls.py": 22,
    "tests/test_alone.py": 18,
    "tests/server/test_edge_head.py": 17,
    "tests/server/test_security.py": 17,
    "tests/sim/test_sim_apis.py": 16,
    "tests/server/test_exits_inprocess.py": 16,
    "tests/server/test_faults.py": 15,
    "tests/core/test_tokenizer_counts.py": 14,
    "tests/hostile/test_framing.py": 14,
    "tests/server/test_edge_upstream.py": 13,
    "tests/sinks/test_otlp_conversations_e2e.py": 13,
    "tests/deploy/test_alerts.py": 13,
    "tests/bench/test_bench.py": 11,
    "tests/core/test_fuzz.py": 11,
    "tests/server/test_asgi_app.py": 10,
    "tests/test_docs.py": 10,
    "tests/core/test_wsframes.py": 10,
    "tests/bench/test_bench_reasoning.py": 10,
    "tests/server/test_label_headers.py": 10,
    "tests/test_layers.py": 9,
    "tests/server/test_shutdown_load.py": 9,
    "tests/server/test_multiproc.py": 9,
    "tests/sim/test_sim_llamacpp.py": 9,
    "tests/bench/test_multiproc_smoke.py": 9,
    "tests/sinks/test_exemplars.py": 8,
    "tests/server/test_edge_headers.py": 8,
    "tests/test_where_changes_go.py": 8,
    "tests/server/test_relay_inprocess.py": 8,
    "tests/server/test_unix_sockets.py": 8,
    "tests/vllm/test_reasoning_vllm.py": 7,  # as test_real_vllm.py
    "tests/server/test_llamacpp_sim_e2e.py": 7,
    "tests/test_build.py": 7,
    "tests/deploy/test_grafana.py": 7,
    "tests/bench/test_workers.py": 7,
    "tests/hostile/test_kit.py": 7,
    "tests/sim/test_sim.py": 6,
    "tests/sim/test_sim_choices.py": 6,
    "tests/server/test_edge_paths.py": 5,
}

#: The modules whose module fixture would wait a minute or more for a process of its own
#: (a vLLM to load, below the tests' priority; the relay benchmark to run, mostly waiting),
#: and the function that starts it. In a parallel run the first pytest process calls it as
#: soon as a worker has collected the module, and the fixture takes what it started
#: (tests/servers.py, `Early`): the worker that runs the module spends that minute on
#: other modules. Imported only then. A starter that two modules name starts once.
EARLY = {
    "tests/vllm/test_real_vllm.py": "tests.vllm.conftest:start_base_and_spec",
    "tests/vllm/test_reasoning_vllm.py": "tests.vllm.conftest:start_reasoning",
    "tests/bench/test_benchmark_smoke.py": "tests.bench.test_benchmark_smoke:start_quick_run",
    # one demo run, 15 s of waiting, whose table both modules read (tests/demo_run.py)
    "tests/server/test_apis_more_e2e.py": "tests.demo_run:start_demo",
    "tests/server/test_ollama_e2e.py": "tests.demo_run:start_demo",
}

EARLY_STARTS = pytest.StashKey[Early]()


def pytest_configure(config: pytest.Config) -> None:
    alone.configure(config)
    _ports_of_this_process(config)
    if getattr(config, "workerinput", None) is not None:
        atexit.register(_end_at_once)  # after the handlers registered from now on
    if _workers(config):
        # short: vLLM's IPC sockets go in it, and a socket's path has at most 107 bytes
        folder = Path(tempfile.mkdtemp(prefix="tokenprobe-early-"))
        config.stash[EARLY_STARTS] = Early(folder)
        os.environ[EARLY_ENV] = str(folder)  # for the workers, started after this
    elif getattr(config, "workerinput", None) is None:
        os.environ.pop(EARLY_ENV, None)  # a serial run inside a parallel one starts its own


def _end_at_once() -> None:
    """A worker's process ends without the interpreter's teardown. By its exit it has
    reported everything and the tests' handlers have run; what is left is freeing its heap,
    object by object, with the other workers doing the same on two cores: the run's summary
    came 9 s after its last test (4.4 s for three directories of tests, 1.5 s without)."""
    with contextlib.suppress(OSError, ValueError):  # closed: nothing left to write
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)


def _workers(config: pytest.Config) -> int:
    """How many workers this process starts (pytest-xdist's -n, at most --maxprocesses):
    none in a worker, a serial run or a collection only."""
    if getattr(config, "workerinput", None) is not None or config.getvalue("collectonly"):
        return 0
    count = int(getattr(config.option, "numprocesses", None) or 0)
    most = getattr(config.option, "maxprocesses", None)
    return min(count, most) if most else count


def _ports_of_this_process(config: pytest.Config) -> None:
    """A parallel worker picks its servers' ports from a slice of its own, and so do the
    processes it starts (they inherit the variable): two workers never pick one port. The
    slice after the workers' is the first process's, for what it starts early."""
    workerinput = getattr(config, "workerinput", None)
    below = below_ephemeral()
    if below is None:
        return
    if workerinput is not None:
        index = int(workerinput["workerid"].removeprefix("gw"))
        count = workerinput["workercount"]
    elif _workers(config):
        index = count = _workers(config)
    else:
        return
    size = len(below) // (count + 1)
    low = below.start + index * size
    os.environ[RANGE_ENV] = f"{low}-{low + size}"


def pytest_xdist_node_collection_finished(node: Any, ids: Sequence[str]) -> None:
    """The first worker to have collected: start what the selected `EARLY` modules wait for."""
    early = node.config.stash.get(EARLY_STARTS, None)
    if early is None or early.begun:
        return
    early.begun = True
    modules = {nodeid.split("::", 1)[0] for nodeid in ids}
    for module, where in EARLY.items():
        if module in modules:
            name, _, function = where.partition(":")
            early.start(getattr(importlib.import_module(name), function))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[object]:
    with alone.held_for(item, nextitem):
        return (yield)


def pytest_unconfigure(config: pytest.Config) -> None:
    alone.unconfigure(config)
    early = config.stash.get(EARLY_STARTS, None)
    if early is not None:
        early.stop()
        os.environ.pop(EARLY_ENV, None)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The long modules first (`SECONDS`), the alone and quiet tests last (tests/alone.py).
    items.sort(key=lambda item: -SECONDS.get(item.nodeid.split("::", 1)[0], 0))  # stable
    alone.last(items)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    if config.getvalue("dist") != "loadscope":
        return None
    return alone.AloneLast(config, log, waiting=WAITING, active=active_workers())


class Running:
    """A started server plus the app object behind it."""

    def __init__(self, server: ThreadedServer | ThreadedHypercorn, app: Any) -> None:
        self.server = server
        self.app = app
        self.url = server.url

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def start_sim() -> Iterator[Callable[..., Running]]:
    started: list[Running] = []

    def start(**config: Any) -> Running:
        config.setdefault("models", (MODEL,))
        app: SimApp = create_sim_app(SimConfig(**config))
        running = Running(ThreadedServer(app).start(), app)
        started.append(running)
        return running

    yield start
    for running in started:
        running.stop()


@pytest.fixture
def sim(start_sim: Callable[..., Running]) -> Running:
    return start_sim(ttft=0.05, tokens_per_second=200.0, output_tokens=16, record_bodies=True)


class ProxyUnderTest(Running):
    app: ProxyApp

    def __init__(
        self, server: ThreadedServer | ThreadedHypercorn, app: ProxyApp, records: list[Measurement]
    ) -> None:
        super().__init__(server, app)
        self.records = records

    @property
    def registry(self) -> CollectorRegistry:
        return self.app.registry

    def sample(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def wait_records(self, n: int, timeout: float = 5.0, exact: bool = False) -> list[Measurement]:
        """The records once there are `n` (each lands just after its response's last byte)."""
        deadline = time.monotonic() + timeout
        while len(self.records) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(self.records) == n if exact else len(self.records) >= n, (
            f"expected {n} records, got {len(self.records)}"
        )
        return self.records


#: Set to "hypercorn" to run the in-process proxy's ASGI app under hypercorn (tests/server).
SERVER_ENV = "TOKENPROBE_TEST_SERVER"


def relay_config() -> dict[str, Any]:
    """uvicorn's options for the data path TOKENPROBE_RELAY names (tests/server/conftest.py
    runs every server test on both): the protocol `tokenprobe serve --relay` runs."""
    from proxy.server.serve import PROTOCOLS

    return {"http": PROTOCOLS[os.environ.get("TOKENPROBE_RELAY", "wire")]}


@pytest.fixture
def start_proxy() -> Iterator[Callable[..., ProxyUnderTest]]:
    started: list[ProxyUnderTest] = []

    def start(upstream: str, *, sinks: Sequence[Sink] = (), **settings: Any) -> ProxyUnderTest:
        settings.setdefault("model_allowlist", (MODEL,))
        settings.setdefault("models_refresh", None)
        settings.setdefault("access_log", "off")  # the records are the recorder's
        recorder = Recorder()
        config = Settings(upstream=upstream, **settings)
        app = assemble(
            config,
            {},
            registry=CollectorRegistry(),
            extra_sinks=[*sinks, recorder],
        )
        server: Any
        if os.environ.get(SERVER_ENV) == "hypercorn":
            server = ThreadedHypercorn(app).start()
        else:
            server = ThreadedServer(app, server_header=False, date_header=False, **relay_config())
            server.start()
        running = ProxyUnderTest(server, app, recorder.records)
        started.append(running)
        return running

    yield start
    for running in started:
        running.stop()


@pytest.fixture
def proxy(sim: Running, start_proxy: Callable[..., ProxyUnderTest]) -> ProxyUnderTest:
    return start_proxy(sim.url)
