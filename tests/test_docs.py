"""The docs' references are the code's: each generated page equals what `python
docs/generate.py` renders now, every metric declared anywhere in proxy/ has its row, and
the hand-written APIs table lists exactly the registry. The site's nav lists every page.

Moved here from tests/test_readme.py when the README became a front page: the settings
table, the metric names and the APIs table checks now read the docs pages that hold them.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import yaml

from proxy.core.apis import APIS
from proxy.core.wsseam import WS_APIS
from proxy.settings import SPECS
from proxy.sinks.logs import KEYS
from tests.paths import ROOT

DOCS = ROOT / "docs"
REGENERATE = "python docs/generate.py"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_generate", DOCS / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


GENERATE = _generator()


def _page(name: str) -> str:
    path = DOCS / "reference" / name
    assert path.is_file(), f"docs/reference/{name} is missing: run {REGENERATE}"
    return path.read_text()


def test_each_reference_page_is_what_the_code_renders() -> None:
    for name, render in GENERATE.PAGES.items():
        assert _page(name) == render(), (
            f"docs/reference/{name} differs from the code: run {REGENERATE} and commit it"
        )


def test_the_settings_reference_holds_the_settings_table_and_every_variable() -> None:
    page = _page("settings.md")
    assert all(f"| {s.flags} | `{s.env}` |" in page for s in SPECS)
    rows = [line for line in page.splitlines() if line.startswith("| `--")]
    assert len(rows) == len(SPECS), f"a row names a setting the code lacks: run {REGENERATE}"


def test_help_texts_are_plain_words_and_the_reference_makes_the_links() -> None:
    """`tokenprobe serve --help` is read on a terminal: a help text names a section in
    words, and docs/generate.py's SECTIONS turns those words into the page's link."""
    linked = [s.flags for s in SPECS if re.search(r"\]\(", s.help)]
    assert linked == [], "write the section's name; add the link to SECTIONS in docs/generate.py"
    for words in GENERATE.SECTIONS:
        assert any(words in s.help for s in SPECS), f"no help text says {words!r} any more"


def _declared_metric_names() -> set[str]:
    """Every `tokenprobe_*` name passed as the first argument of a call in proxy/: the
    metric declarations (Counter(...), Histogram(...), and the factories around them)."""
    names = set()
    for path in (ROOT / "proxy").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            first = node.args[0]
            if (
                isinstance(first, ast.Constant)
                and isinstance(first.value, str)
                and re.fullmatch(r"tokenprobe_[a-z0-9_]+", first.value)
            ):
                names.add(first.value)
    return names


def test_every_metric_declared_in_proxy_has_its_reference_row() -> None:
    rows = {row["name"] for row in GENERATE.metric_rows()}
    exposed = {name.removesuffix("_total") for name in rows}
    missing = sorted(_declared_metric_names() - exposed)
    assert missing == [], (
        f"declared in proxy/ but not in the metrics reference: {missing}; add the place that "
        f"declares them to _declarations() in docs/generate.py, then run {REGENERATE}"
    )
    page = _page("metrics.md")
    headings = set(re.findall(r"^## `(tokenprobe_[a-z0-9_]+)`", page, re.M))
    assert headings == rows, f"the metrics reference names what the code lacks: run {REGENERATE}"


def test_every_metric_row_says_its_type_labels_buckets_and_help() -> None:
    rows = list(GENERATE.metric_rows())
    assert len({row["name"] for row in rows}) == len(rows)  # no family counted twice
    for row in rows:
        assert row["type"] in ("counter", "gauge", "histogram"), row
        assert row["help"].strip(), row["name"]
        assert bool(row["buckets"]) == (row["type"] == "histogram"), row["name"]


def _hand_apis_table() -> dict[str, str]:
    """The endpoint label -> paths cell of each row of docs/apis.md's table."""
    rows = {}
    for line in (DOCS / "apis.md").read_text().splitlines():
        if line.startswith("| `"):
            label, paths = (cell.strip() for cell in line.strip("|").split("|")[:2])
            rows[label.strip("`")] = paths
    return rows


def test_apis_measured_table_lists_exactly_the_registry() -> None:
    rows = _hand_apis_table()
    assert sorted(rows) == sorted(api.endpoint for api in APIS), (
        "docs/apis.md's table must have one row per API in proxy/core/apis APIS"
    )
    for api in APIS:
        assert rows[api.endpoint] == ", ".join(f"`{path}`" for path in api.paths), api.endpoint


def test_the_apis_reference_lists_exactly_the_registry() -> None:
    page = _page("apis.md")
    labels = re.findall(r"^\| `([^`]+)` \|", page, re.M)
    assert sorted(labels) == sorted([api.endpoint for api in APIS] + [w.endpoint for w in WS_APIS])


def _nav_pages(nav: object) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in _nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    return []


def test_the_nav_lists_every_page_and_only_pages_that_exist() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(nav) == pages, "add the page to the nav in mkdocs.yml (or remove the line)"
    # A page left out of the nav fails `mkdocs build --strict` too: keep that a warning.
    assert config["strict"] is True
    assert config["validation"]["nav"]["omitted_files"] == "warn"


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """`mkdocs build --strict`: a broken link or anchor, a missing page or one left out
    of the nav fails it (mkdocs.yml's validation turns those into warnings)."""
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "reference" / "metrics" / "index.html").is_file()


def test_ci_builds_the_site_strictly_and_the_dev_extra_installs_mkdocs() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "mkdocs build --strict" in ci
    pyproject = (ROOT / "pyproject.toml").read_text()
    dev = pyproject.split("dev = [", 1)[1].split("]\n", 1)[0]
    assert '"mkdocs' in dev and '"mkdocs-material' in dev


def test_the_access_log_table_lists_every_key_in_the_order_a_line_has_them() -> None:
    """docs/traces-and-logs.md's "Keys, in this order" table is the access log's KEYS
    (tests/sinks/test_logs.py checks a real line against them), then `labels`: ten keys
    were once missing from it."""
    page = (DOCS / "traces-and-logs.md").read_text()
    table = page.split("Keys, in this order:", 1)[1].split("\n\n", 2)[1]
    documented = [
        key
        for row in table.splitlines()
        if row.startswith("| `")
        for key in re.findall(r"`([a-z0-9_]+)`", row.split(" | ", 1)[0])
    ]
    assert documented == [*KEYS, "labels"]


def test_the_metrics_page_lists_every_reason_a_connection_is_closed_for() -> None:
    """docs/metrics.md's `reason` item names each value of
    tokenprobe_connections_closed_total's label (`malformed` was missing)."""
    from proxy.server.protocol import _REASONS

    page = (DOCS / "metrics.md").read_text()
    item = page.split("- `reason` (`tokenprobe_connections_closed_total`", 1)[1]
    item = item.split("(`tokenprobe_trace_export_failures_total`)", 1)[0]
    assert [reason for reason in _REASONS if f"`{reason}`" not in item] == []
