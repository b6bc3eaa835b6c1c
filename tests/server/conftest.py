"""Every server test runs on both data paths: the wire and the ASGI relay.

`relay` sets TOKENPROBE_RELAY, which `tokenprobe serve` processes (tests.servers.spawn)
read like any setting and the in-process proxy (tests/conftest.py's start_proxy) reads
to pick uvicorn's protocol. A test that makes sense for one path only says why and skips
the other with `only_on(relay, ...)`.
"""

from __future__ import annotations

import pytest


@pytest.fixture(params=["wire", "asgi"], autouse=True)
def relay(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    name: str = request.param
    monkeypatch.setenv("TOKENPROBE_RELAY", name)
    return name


def only_on(relay: str, wanted: str, why: str) -> None:
    if relay != wanted:
        pytest.skip(f"{wanted} only: {why}")
