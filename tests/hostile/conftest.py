"""The hostile-peer suite: each test runs on both data paths (the wire and the ASGI relay),
in a real `tokenprobe serve` process in front of a `RawUpstream` (tests/hostile/peers.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest

from tests.edge_backend import serving
from tests.hostile.peers import RawUpstream, raw_upstream


@pytest.fixture(params=["wire", "asgi"])
def relay(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("TOKENPROBE_RELAY", request.param)
    return str(request.param)


@pytest.fixture
def upstream() -> Iterator[RawUpstream]:
    with raw_upstream() as server:
        yield server


@pytest.fixture
def proxy(relay: str) -> Callable[..., AbstractContextManager[str]]:
    """`with proxy(upstream.url, *flags) as base:` a `tokenprobe serve` on the test's path."""

    def start(url: str, *flags: str) -> AbstractContextManager[str]:
        return serving(url, *flags)

    return start
