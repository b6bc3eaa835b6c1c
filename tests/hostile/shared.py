"""One `tokenprobe serve` for each data path, upstream URL and set of flags, shared by a
test module's tests, and what a test counted on it since it took it.

Each start costs about 0.4 s of CPU and 0.6 s of a worker's time, and test_client.py and
test_upstream.py once started 108 of them, one a test. A test still meets its proxy as a
new one (conftest.py's `upstream` says how): nothing of the tests before it in flight or
pooled, and its counts read from its own start (`counted`, `counted_when`).
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.edge_backend import serving_process
from tests.scrape import Change, Delta, Scrape, scrape
from tests.servers import default_trust

#: The in-flight gauges: measured requests and WebSocket sessions.
IN_FLIGHT = ("tokenprobe_requests_in_flight", "tokenprobe_websocket_sessions_in_flight")

#: Each shared proxy's /metrics when the test now running took it.
_TAKEN: dict[str, Scrape] = {}
#: The baseline of a proxy that is the test's own: nothing counted before the test.
NOTHING = Scrape(())


class SharedProxies:
    """The module's proxies, started when first asked for and stopped with the module;
    each writes its log to a file in `logs` (a pipe nobody reads would fill up)."""

    def __init__(self, logs: Path) -> None:
        self._logs = logs
        self._stack = contextlib.ExitStack()
        self._running: dict[tuple[str, ...], tuple[str, subprocess.Popen[bytes]]] = {}
        # The proxies taken since `wait_idle` last found them idle: only these can have
        # anything in flight or pooled from a test since.
        self._taken_since_idle: set[str] = set()

    def __enter__(self) -> SharedProxies:
        return self

    def __exit__(self, *exc: object) -> None:
        # All told to stop before any is waited for: each takes about 0.2 s to shut down,
        # and one after another a module's proxies held its last test up to 3 s.
        processes = [process for _, process in self._running.values()]
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
        self._stack.close()  # what is left: any process still up (stop), the log files

    @contextlib.contextmanager
    def take(self, relay: str, upstream: str, *flags: str) -> Iterator[str]:
        """`with take(relay, url, *flags) as base:` the proxy on `relay` (the caller set
        TOKENPROBE_RELAY to it) in front of `upstream` with `flags`."""
        key = (relay, upstream, *flags)
        if key not in self._running:
            log_file = self._logs / f"proxy-{len(self._running)}.log"
            log = self._stack.enter_context(log_file.open("wb"))
            self._running[key] = self._stack.enter_context(
                serving_process(upstream, *flags, stderr=log)
            )
        base, process = self._running[key]
        assert process.poll() is None, f"the shared proxy {key} exited ({process.returncode})"
        self._taken_since_idle.add(base)
        _TAKEN[base] = scrape(base)
        try:
            yield base
        finally:
            del _TAKEN[base]

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Every proxy with nothing measured in flight. The scrape that says so was
        answered after the proxy had read every hang-up and client close sent before it
        (they arrived first), so none of the connections they ended is still pooled.

        Only the proxies taken since the last call are asked: one that no test has
        taken since has had no client, so it is as idle as it was found then. Asking
        every proxy of the module before every test cost test_upstream.py and
        test_client.py about 0.45 s a test, a third of their time."""
        for base in sorted(self._taken_since_idle):
            wait_idle(base, timeout)
        self._taken_since_idle.clear()


@dataclass
class DataPath:
    """A proxy's data path: the wire, or the ASGI relay on its aiohttp transport (the
    default) or its httpx one, for the tests a difference between the ASGI relay's two
    HTTP clients concerns (the `path` fixture; `relay` runs the wire and aiohttp only)."""

    name: str
    relay: str
    flags: tuple[str, ...]
    shared: SharedProxies

    def proxy(self, upstream: str) -> AbstractContextManager[str]:
        """`with path.proxy(upstream.url) as base:` a proxy on this path."""
        return self.shared.take(self.relay, upstream, *self.flags)


def wait_idle(base: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any((now := in_flight(base)).total(name) for name in IN_FLIGHT):
        assert time.monotonic() < deadline, f"{base} kept requests in flight: {now.totals()}"
        time.sleep(0.02)


def in_flight(base: str) -> Scrape:
    """The proxy's in-flight gauges alone (`name[]`): the whole page took the proxy a few
    ms to render, and its next render, the test's own scrape (`take`), waited nine times
    that (proxy/server/exposition.py); parsed here, about 6 ms of CPU more."""
    names = [("name[]", name) for name in IN_FLIGHT]
    got = httpx.get(base + "/metrics", params=names, timeout=10, verify=default_trust())
    assert got.status_code == 200, f"/metrics answered {got.status_code}: {got.text[:500]}"
    lines = (line for line in got.text.splitlines() if _sample_name(line) in IN_FLIGHT)
    return Scrape.parse("".join(line + "\n" for line in lines))


def _sample_name(line: str) -> str:
    """A sample line's name (what comes before its labels or its value)."""
    return line.partition("{")[0].partition(" ")[0]


def counted(base: str, name: str, /, **labels: str) -> float:
    """How much `name{labels}` grew on the proxy at `base` since this test took it (all of
    it on a proxy of the test's own)."""
    return Change(_taken(base), scrape(base))(name, **labels)


def counted_when(base: str, name: str, grown_by: float, /, **labels: str) -> Change:
    """`Delta.when` since this test took the proxy at `base`."""
    return Delta(base, _taken(base)).when(name, grown_by, **labels)


def _taken(base: str) -> Scrape:
    return _TAKEN.get(base, NOTHING)


def until(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Whether `condition` holds within `timeout` seconds, asked every 20 ms."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()
