"""The README documents every setting and every metric, and its two commands are real."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from proxy.settings import SPECS, settings_table
from proxy.sinks.metrics import Metrics, WsMetrics
from tests.paths import ROOT

README = (ROOT / "README.md").read_text()


def test_the_settings_table_is_the_one_rendered_from_the_declarations() -> None:
    # Regenerate it with `python -m proxy.settings` after declaring a setting.
    section = README.split("## Settings", 1)[1].split("\n## ", 1)[0]
    assert settings_table() in section
    assert all(f"`{s.env}`" in section for s in SPECS)


def test_every_metric_is_documented() -> None:
    names = []
    registry = CollectorRegistry()
    Metrics(registry)
    WsMetrics(registry)
    for family in registry.collect():
        names.append(family.name + ("_total" if family.type == "counter" else ""))
    # or on a docs page of its own (docs/hostile-peers.md), while the README moves to docs/
    pages = README + "".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    missing = [name for name in names if name not in pages]
    assert missing == []


def test_readme_gives_the_two_commands() -> None:
    assert "pip install . && tokenprobe demo" in README
    assert "pip install -e '.[dev]' && pytest" in README
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install -e '.[dev]' && pytest" in ci


def _apis_table() -> dict[str, str]:
    """The endpoint label -> paths cell of each row of the README's "APIs measured" table."""
    section = README.split("## APIs measured", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if line.startswith("| `"):
            label, paths = (cell.strip() for cell in line.strip("|").split("|")[:2])
            rows[label.strip("`")] = paths
    return rows


def test_apis_measured_table_lists_exactly_the_registry() -> None:
    from proxy.core.apis import APIS

    rows = _apis_table()
    assert sorted(rows) == sorted(api.endpoint for api in APIS)
    for api in APIS:
        assert rows[api.endpoint] == ", ".join(f"`{path}`" for path in api.paths), api.endpoint
