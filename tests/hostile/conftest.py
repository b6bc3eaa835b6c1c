"""The hostile-peer suite: each test runs on both data paths (the wire and the ASGI relay),
in a real `tokenprobe serve` process in front of a `RawUpstream` (tests/hostile/peers.py).

A module's tests share one upstream, and one proxy for each data path, upstream URL and set
of flags (tests/hostile/shared.py), and each test meets both as new ones: before it, every
proxy of the module has nothing in flight (a request of the test before, even one the
proxy sent again on a new connection, has ended), then the upstream hangs up every
connection and forgets the test before (its scripts, connections and bytes), so no proxy
keeps one of them pooled; the test reads the proxy's counts from its own start.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from functools import partial

import pytest

from tests.hostile.peers import RawUpstream, raw_upstream
from tests.hostile.shared import DataPath, SharedProxies


@pytest.fixture(params=["wire", "asgi"])
def relay(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("TOKENPROBE_RELAY", request.param)
    return str(request.param)


@pytest.fixture(scope="module")
def shared_upstream() -> Iterator[RawUpstream]:
    with raw_upstream() as server:
        yield server


@pytest.fixture(scope="module")
def shared_proxies(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedProxies]:
    with SharedProxies(tmp_path_factory.mktemp("proxy-logs")) as proxies:
        yield proxies


@pytest.fixture
def upstream(shared_upstream: RawUpstream, shared_proxies: SharedProxies) -> Iterator[RawUpstream]:
    shared_proxies.wait_idle()
    shared_upstream.reset()
    yield shared_upstream
    shared_upstream.hang_up()  # a request the test left held ends now, not in the next one


@pytest.fixture
def proxy(relay: str, shared_proxies: SharedProxies) -> Callable[..., AbstractContextManager[str]]:
    """`with proxy(upstream.url, *flags) as base:` a `tokenprobe serve` on the test's path."""
    return partial(shared_proxies.take, relay)


@pytest.fixture(params=["wire", "asgi", "asgi-httpx"])
def path(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, shared_proxies: SharedProxies
) -> DataPath:
    name = str(request.param)
    relay, _, transport = name.partition("-")
    monkeypatch.setenv("TOKENPROBE_RELAY", relay)
    flags = ("--upstream-transport", transport) if transport else ()
    return DataPath(name, relay, flags, shared_proxies)
