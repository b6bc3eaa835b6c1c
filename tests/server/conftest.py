"""Every server test runs on both data paths: the wire and the ASGI relay.

`relay` sets TOKENPROBE_RELAY, which `tokenprobe serve` processes (tests.servers.spawn)
read like any setting and the in-process proxy (tests/conftest.py's start_proxy) reads
to pick uvicorn's protocol. A test that makes sense for one path only says why and skips
the other with `only_on(relay, ...)`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module", params=["wire", "asgi"], autouse=True)
def relay(request: pytest.FixtureRequest) -> Iterator[str]:
    """Module-scoped, so a module's shared proxy (a module fixture that takes `relay`)
    is started once per data path."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield use_relay(request.param, monkeypatch)


def only_on(relay: str, wanted: str, why: str) -> None:
    if relay != wanted:
        pytest.skip(f"{wanted} only: {why}")


#: The end-to-end modules also run the ASGI app under hypercorn: the app is a product.
WITH_HYPERCORN = ["wire", "asgi", "hypercorn"]


def use_relay(name: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("TOKENPROBE_RELAY", "asgi" if name == "hypercorn" else name)
    if name == "hypercorn":
        monkeypatch.setenv("TOKENPROBE_TEST_SERVER", "hypercorn")
    return name
