"""Shared fixtures: the simulator and the proxy, each on real uvicorn on loopback."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
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
from tests.servers import ThreadedHypercorn, ThreadedServer

MODEL = "sim-model"

# No per-example deadline: a property test checks what the code does, and an example's
# wall time on two shared cores says more about the other workers than about the code
# (one took 328 ms against the default 200 ms in a parallel run, 0.1 ms on its rerun).
settings.register_profile("tokenprobe", deadline=None)
settings.load_profile("tokenprobe")

bytecode.keep_outside_the_tree()

#: The most workers `-n auto` starts (pyproject.toml's addopts): each runs servers of its own.
MAX_WORKERS = 8


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """Two workers a core: most tests wait on sockets, servers and subprocesses, not the
    CPU (the whole suite uses about half the CPU time it takes in wall time, serially).
    Each module runs whole on one worker (--dist loadscope), so a module fixture (a vLLM,
    a benchmark run, a Prometheus) starts once, as it does serially."""
    return min(MAX_WORKERS, 2 * (os.cpu_count() or 1))


#: The modules that take minutes (a real backend to start, a benchmark run), longest first,
#: then those with a test of 12 to 30 s (a documented 24 s bench run, a demo, a stack of
#: Prometheus and Grafana). They go first, so that a parallel run, which hands out modules
#: in the order collected, neither ends waiting on one nor makes the alone tests wait for
#: one (a drain of 18 s with two workers idle, for the bench run of the docs).
LONG_MODULES = (
    "tests/vllm/",
    "tests/bench/test_benchmark_smoke.py",
    "tests/llamacpp/",
    "tests/test_docs_commands.py",
    "tests/deploy/test_grafana_live.py",
    "tests/server/test_ollama_e2e.py",
    "tests/server/test_apis_more_e2e.py",
    "tests/deploy/test_alerts.py",
)


def pytest_configure(config: pytest.Config) -> None:
    alone.configure(config)
    _ports_of_this_worker(config)


def _ports_of_this_worker(config: pytest.Config) -> None:
    """A parallel worker picks its servers' ports from a slice of its own, and so do the
    processes it starts (they inherit the variable): two workers never pick one port."""
    workerinput = getattr(config, "workerinput", None)
    below = below_ephemeral()
    if workerinput is None or below is None:
        return
    index, count = int(workerinput["workerid"].removeprefix("gw")), workerinput["workercount"]
    size = len(below) // count
    low = below.start + index * size
    os.environ[RANGE_ENV] = f"{low}-{low + size}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[object]:
    with alone.held_for(item, nextitem):
        return (yield)


def pytest_unconfigure(config: pytest.Config) -> None:
    alone.unconfigure(config)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The long modules first, the alone tests last (tests/alone.py): by then the long
    # modules are done, so the alone tests do not wait for a vLLM to start.
    def rank(item: pytest.Item) -> int:
        starts = [i for i, prefix in enumerate(LONG_MODULES) if item.nodeid.startswith(prefix)]
        return starts[0] if starts else len(LONG_MODULES)

    items.sort(key=rank)  # stable: the rest keep the order they were found in
    alone.last(items)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    return alone.AloneLast(config, log) if config.getvalue("dist") == "loadscope" else None


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
