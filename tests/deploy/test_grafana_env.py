"""grafana/provisioning reads its datasources' URLs and its dashboards' folder from
Grafana's environment, so one set of files serves the Compose stacks and a Grafana run
outside Compose.

Grafana expands `$NAME` and `${NAME}` in the values of a provisioning file from its
environment when it reads the file, with no default for an unset one (grafana/grafana
pkg/services/provisioning/values/values.go `interpolateValue`: Go's `os.ExpandEnv`): an
unset variable would be an empty URL. So every variable the files read must be set by
each Compose stack's Grafana and by the docs' block for a Grafana outside Compose."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.test_deploy import COMPOSE_FILES, compose
from tests.paths import ROOT

PROVISIONING = ROOT / "grafana" / "provisioning"
#: `$NAME` or `${NAME}`, as Go's os.Expand reads them.
VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


def expanded(value: Any, environ: dict[str, str]) -> Any:
    """A provisioning file's data with every string value expanded from `environ`, as
    Grafana expands it; a variable missing from `environ` raises KeyError."""
    if isinstance(value, dict):
        return {key: expanded(item, environ) for key, item in value.items()}
    if isinstance(value, list):
        return [expanded(item, environ) for item in value]
    if isinstance(value, str):
        return VARIABLE.sub(lambda m: environ[m.group(1) or m.group(2)], value)
    return value


def provisioned() -> dict[str, Any]:
    """Each provisioning file's data, by its path under grafana/provisioning."""
    return {
        path.relative_to(PROVISIONING).as_posix(): yaml.safe_load(path.read_text())
        for path in sorted(PROVISIONING.glob("*/*.yaml"))
    }


def variables() -> set[str]:
    """The variables the files' values read (comments are not values)."""
    texts = [yaml.safe_dump(data) for data in provisioned().values()]
    return {m[0] or m[1] for text in texts for m in VARIABLE.findall(text)}


def test_the_files_read_their_hosts_and_folder_from_the_environment() -> None:
    assert variables() == {"PROMETHEUS_URL", "TEMPO_URL", "DASHBOARDS_PATH"}


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_each_compose_grafana_sets_every_variable_to_its_own_services(path: Path) -> None:
    services = compose(path)["services"]
    environ = services["grafana"]["environment"]
    data = expanded(provisioned(), environ)  # KeyError: a variable the stack leaves unset
    for source in data["datasources/datasources.yaml"]["datasources"]:
        host = re.match(r"http://([\w-]+):\d+$", source["url"])
        assert host is not None and host[1] in services, source["url"]
    for provider in data["dashboards/dashboards.yaml"]["providers"]:
        assert provider["options"]["path"] == environ["DASHBOARDS_PATH"]
        assert environ["DASHBOARDS_PATH"].startswith("/")


def test_the_docs_set_every_variable_outside_compose() -> None:
    section = (ROOT / "docs" / "deployment.md").read_text().split("### Grafana outside Compose")[1]
    block = section.split("```")[1]
    environ = dict(line.split("=", 1) for line in block.splitlines() if re.match(r"[A-Z_]+=", line))
    assert sorted(variables() - set(environ)) == []
    data = expanded(provisioned(), environ)
    urls = [s["url"] for s in data["datasources/datasources.yaml"]["datasources"]]
    assert all(url.startswith("http://127.0.0.1:") for url in urls), urls
    assert environ["GF_PATHS_PROVISIONING"].endswith("/grafana/provisioning")
    assert environ["DASHBOARDS_PATH"].startswith("/")
    assert environ["DASHBOARDS_PATH"].endswith("/grafana/dashboards")
