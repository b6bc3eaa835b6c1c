"""The simulator's tests: each module starts one simulator (its own `sim` fixture, with
the config it tests); these give each test a clean record, the app and a warm client."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from proxy.sim.app import SimApp
from tests.servers import ThreadedServer
from tests.sim.test_sim_support import warm_client


@pytest.fixture
def url(sim: tuple[ThreadedServer, SimApp]) -> str:
    sim[1].state.reset()
    return sim[0].url


@pytest.fixture
def app(sim: tuple[ThreadedServer, SimApp]) -> SimApp:
    return sim[1]


@pytest.fixture
def client(url: str) -> Iterator[httpx.Client]:
    with warm_client(url) as c:
        yield c
