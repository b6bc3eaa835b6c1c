"""Every server test that runs a proxy runs on both data paths: the wire and the ASGI relay.

`relay` sets TOKENPROBE_RELAY, which `tokenprobe serve` processes (tests.servers.spawn)
read like any setting and the in-process proxy (tests/conftest.py's start_proxy) reads
to pick uvicorn's protocol. The paths a test runs on are its `paths` mark:

- no mark: the wire and the ASGI relay;
- `@paths("wire", why="...")`: a behaviour only that path has (`paths(*WITH_HYPERCORN)`
  adds the ASGI app under hypercorn);
- `@no_proxy`: a test that runs no proxy (a parser, the settings, a process refused before
  it serves) runs once, with TOKENPROBE_RELAY unset.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import SERVER_ENV

BOTH = ("wire", "asgi")
#: The end-to-end modules also run the ASGI app under hypercorn: the app is a product.
WITH_HYPERCORN = ("wire", "asgi", "hypercorn")


def paths(*names: str, why: str) -> pytest.MarkDecorator:
    """The test runs on these paths only; `why` says why the others do not apply."""
    assert names and all(name in WITH_HYPERCORN for name in names), names
    return pytest.mark.paths(*names, why=why)


#: The test runs no proxy: it runs once, on no path.
no_proxy = pytest.mark.paths()


@pytest.hookimpl(tryfirst=True)  # the path leads the test id: test_x[wire-...]
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    mark = metafunc.definition.get_closest_marker("paths")
    names = BOTH if mark is None else mark.args
    if names and "relay" in metafunc.fixturenames:
        metafunc.parametrize("relay", names, indirect=True, scope="module")


@pytest.fixture(scope="module", autouse=True)
def relay(request: pytest.FixtureRequest) -> Iterator[str]:
    """Module-scoped, so a module's shared proxy (a module fixture that takes `relay`)
    is started once per data path. "" in a `no_proxy` test."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        name = getattr(request, "param", None)
        if name is None:
            monkeypatch.delenv("TOKENPROBE_RELAY", raising=False)
            monkeypatch.delenv(SERVER_ENV, raising=False)
            yield ""
        else:
            yield use_relay(name, monkeypatch)


def use_relay(name: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("TOKENPROBE_RELAY", "asgi" if name == "hypercorn" else name)
    if name == "hypercorn":
        monkeypatch.setenv(SERVER_ENV, "hypercorn")
    return name
