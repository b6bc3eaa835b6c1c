"""Structural checks of every dashboard in grafana/dashboards and of Grafana's provisioning.

What a dashboard must hold to: unique panel ids, a grid that fits 24 columns with no
overlap, datasources that resolve (the ${datasource} variable or a provisioned uid),
an expression in every target that only uses defined variables, multi-value variables
matched with =~, units and descriptions on every panel, exemplars on the latency
panels whose histograms carry them. `test_expressions_are_valid_promql` parses every
expression with promtool, offline. tests/deploy/test_grafana_live.py runs them on Prometheus.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.paths import ROOT
from tests.prom import require_binary

DASHBOARD_DIR = ROOT / "grafana" / "dashboards"
PROVISIONING = ROOT / "grafana" / "provisioning"
DASHBOARDS = sorted(DASHBOARD_DIR.glob("*.json"))


def _labelled() -> Path:
    """The stock dashboard as `tokenprobe dashboard --label-header x-team=team
    --label-header x-app=app` writes it, generated afresh (so it never goes stale)."""
    from proxy.dashboard import with_labels

    stock = json.loads((DASHBOARD_DIR / "tokenprobe.json").read_text())
    path = Path(tempfile.mkdtemp(prefix="tokenprobe-grafana-")) / "tokenprobe-team-app.json"
    path.write_text(json.dumps(with_labels(stock, ("team", "app")), indent=2))
    return path


LABELLED = _labelled()
#: Every dashboard the structural and live checks run on.
CHECKED = [*DASHBOARDS, LABELLED]
GRID_COLUMNS = 24

#: What Grafana's own variables stand for when the tests run expressions on Prometheus.
BUILTIN_VARIABLES = {
    "__rate_interval": "1m",
    "__interval": "15s",
    "__interval_ms": "15000",
    "__range": "1h",
    "__range_s": "3600",
    "__range_ms": "3600000",
}
#: Test values of the dashboards' own variables: "All" is `.*` (their allValue).
VARIABLE_VALUES = {
    "model": ".*",
    "endpoint": ".*",
    "datasource": "prometheus",
    "team": ".*",  # LABELLED's attribution labels
    "app": ".*",
}
#: Histograms whose observations carry trace-id exemplars.
EXEMPLAR_METRICS = (
    "tokenprobe_time_to_first_token_seconds",
    "tokenprobe_request_time_per_output_token_seconds",
    "tokenprobe_e2e_request_latency_seconds",
)
_VARIABLE = re.compile(r"\$\{(\w+)(?::[\w]+)?\}|\[\[(\w+)\]\]|\$(\w+)")


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def iter_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows and the panels inside collapsed rows included."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def iter_targets(dashboard: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for panel in iter_panels(dashboard):
        for target in panel.get("targets", []):
            yield panel, target


def substitute(expr: str, values: dict[str, str] | None = None) -> str:
    """The expression with Grafana's variables replaced, as Grafana sends it to Prometheus."""
    table = {**BUILTIN_VARIABLES, **VARIABLE_VALUES, **(values or {})}

    def replace(match: re.Match[str]) -> str:
        name = next(g for g in match.groups() if g)
        if name not in table:
            raise KeyError(f"unknown Grafana variable ${name} in {expr!r}")
        return table[name]

    return _VARIABLE.sub(replace, expr)


def provisioned_datasources() -> list[dict[str, Any]]:
    sources: list[dict[str, Any]] = []
    for path in sorted((PROVISIONING / "datasources").glob("*.y*ml")):
        sources.extend(yaml.safe_load(path.read_text()).get("datasources", []))
    return sources


def dashboard_ids(paths: list[Path]) -> list[str]:
    return [p.name for p in paths]


def test_there_is_a_dashboard() -> None:
    assert DASHBOARDS, f"no dashboards in {DASHBOARD_DIR}"


def test_dashboard_uids_are_unique() -> None:
    uids = [load(p).get("uid") for p in DASHBOARDS]
    assert all(uids), "every dashboard needs a fixed uid (links and provisioning rely on it)"
    assert len(set(uids)) == len(uids), uids


@pytest.mark.parametrize("path", CHECKED, ids=dashboard_ids(CHECKED))
class TestDashboard:
    def test_has_title_and_schema_version(self, path: Path) -> None:
        dashboard = load(path)
        assert dashboard.get("title")
        assert isinstance(dashboard.get("schemaVersion"), int)
        assert "id" not in dashboard or dashboard["id"] is None, "drop the instance-local id"

    def test_panel_ids_are_unique(self, path: Path) -> None:
        ids = [p.get("id") for p in iter_panels(load(path))]
        assert all(isinstance(i, int) for i in ids), ids
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        assert not duplicates, f"duplicate panel ids {duplicates}"

    def test_grid_fits_24_columns_without_overlap(self, path: Path) -> None:
        placed: list[tuple[str, int, int, int, int]] = []
        for panel in iter_panels(load(path)):
            grid = panel.get("gridPos", {})
            x, y, w, h = (grid.get(k) for k in ("x", "y", "w", "h"))
            title = panel.get("title", panel.get("id"))
            assert all(isinstance(v, int) for v in (x, y, w, h)), f"{title}: gridPos {grid}"
            assert x >= 0 and y >= 0 and w >= 1 and h >= 1, f"{title}: gridPos {grid}"
            assert x + w <= GRID_COLUMNS, f"{title}: x + w = {x + w} > {GRID_COLUMNS}"
            for other, ox, oy, ow, oh in placed:
                overlaps = x < ox + ow and ox < x + w and y < oy + oh and oy < y + h
                assert not overlaps, f"{title!r} overlaps {other!r}"
            placed.append((str(title), x, y, w, h))

    def test_rows_are_full_width(self, path: Path) -> None:
        for panel in iter_panels(load(path)):
            if panel["type"] == "row":
                assert panel["gridPos"]["w"] == GRID_COLUMNS and panel["gridPos"]["x"] == 0
                assert panel.get("title")

    def test_datasources_resolve(self, path: Path) -> None:
        dashboard = load(path)
        variables = {
            v["name"] for v in dashboard["templating"]["list"] if v["type"] == "datasource"
        }
        known = {f"${{{name}}}" for name in variables} | {f"${name}" for name in variables}
        known |= {ds["uid"] for ds in provisioned_datasources()}
        known |= {"-- Grafana --", "grafana"}  # Grafana's built-in annotation source

        def check(where: str, ref: Any) -> None:
            assert isinstance(ref, dict), f"{where}: datasource {ref!r} is not a {{type, uid}} ref"
            assert ref.get("uid") in known, f"{where}: datasource uid {ref.get('uid')!r} unknown"

        for annotation in dashboard.get("annotations", {}).get("list", []):
            check(f"annotation {annotation.get('name')}", annotation.get("datasource"))
        for variable in dashboard["templating"]["list"]:
            if variable["type"] == "query":
                check(f"variable {variable['name']}", variable.get("datasource"))
        for panel in iter_panels(dashboard):
            if panel["type"] == "row":
                continue
            check(f"panel {panel['title']!r}", panel.get("datasource"))
            for target in panel.get("targets", []):
                check(
                    f"panel {panel['title']!r} target {target.get('refId')}", target["datasource"]
                )

    def test_every_panel_has_targets_with_expressions(self, path: Path) -> None:
        for panel in iter_panels(load(path)):
            if panel["type"] == "row":
                continue
            targets = panel.get("targets", [])
            assert targets, f"{panel['title']!r} has no query"
            ref_ids = [t.get("refId") for t in targets]
            assert len(set(ref_ids)) == len(ref_ids), f"{panel['title']!r}: refIds {ref_ids}"
            for target in targets:
                assert str(target.get("expr", "")).strip(), f"{panel['title']!r}: empty expr"

    def test_panels_are_readable(self, path: Path) -> None:
        for panel in iter_panels(load(path)):
            if panel["type"] == "row":
                continue
            assert panel.get("title"), f"panel {panel['id']} has no title"
            assert len(panel.get("description", "")) >= 40, f"{panel['title']!r}: describe it"
            if panel["type"] in {"timeseries", "stat"}:
                unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
                assert unit, f"{panel['title']!r} has no unit"

    def test_variables_are_well_formed(self, path: Path) -> None:
        variables = load(path)["templating"]["list"]
        names = [v["name"] for v in variables]
        assert len(set(names)) == len(names), names
        by_name = {v["name"]: v for v in variables}
        assert by_name["datasource"]["type"] == "datasource"
        assert by_name["datasource"]["query"] == "prometheus"
        for variable in variables:
            if variable["type"] != "query":
                continue
            query = variable.get("query")
            text = query.get("query") if isinstance(query, dict) else query
            assert text and text == variable.get("definition"), variable["name"]
            assert re.match(r"label_values\(", text), f"{variable['name']}: {text}"
            if variable.get("includeAll"):
                # `.*` keeps series that appear after the dashboard loaded.
                assert variable.get("allValue") == ".*", variable["name"]
        for name in ("model", "endpoint"):
            assert by_name[name]["multi"] and by_name[name]["includeAll"], name

    def test_expressions_use_only_defined_variables(self, path: Path) -> None:
        dashboard = load(path)
        defined = {v["name"] for v in dashboard["templating"]["list"]} | set(BUILTIN_VARIABLES)
        for panel, target in iter_targets(dashboard):
            for match in _VARIABLE.finditer(target["expr"]):
                name = next(g for g in match.groups() if g)
                assert name in defined, f"{panel['title']!r}: ${name} is not defined"

    def test_multi_value_variables_are_matched_as_regex(self, path: Path) -> None:
        # A multi-value variable renders as (a|b): only =~ matches it.
        dashboard = load(path)
        multi = [v["name"] for v in dashboard["templating"]["list"] if v.get("multi")]
        for panel, target in iter_targets(dashboard):
            for name in multi:
                bad = re.search(rf'[^=!]=\s*"\$\{{?{name}\b|!=\s*"\${{?{name}\b', target["expr"])
                assert not bad, f"{panel['title']!r}: use =~ or !~ with ${name}"

    def test_latency_panels_link_exemplars(self, path: Path) -> None:
        for panel, target in iter_targets(load(path)):
            if panel["type"] != "timeseries":
                continue
            if any(f"{metric}_bucket" in target["expr"] for metric in EXEMPLAR_METRICS):
                assert target.get("exemplar") is True, f"{panel['title']!r} {target['refId']}"

    def test_variable_queries_and_targets_substitute_cleanly(self, path: Path) -> None:
        for panel, target in iter_targets(load(path)):
            expr = substitute(target["expr"])
            assert "$" not in expr, f"{panel['title']!r}: {expr}"


def test_expressions_are_valid_promql(tmp_path: Path) -> None:
    """Every expression, variables substituted, parses (promtool check rules, offline)."""
    promtool = require_binary("promtool")
    rules = []
    where = []
    for path in CHECKED:
        for panel, target in iter_targets(load(path)):
            rules.append(
                {"record": f"dashboard:expr_{len(rules)}", "expr": substitute(target["expr"])}
            )
            where.append(f"{path.name}: {panel['title']!r} {target['refId']}")
        for variable in load(path)["templating"]["list"]:
            if variable["type"] == "query":
                # label_values(selector, label): the selector must be valid PromQL.
                selector = re.match(r"label_values\((.*),\s*\w+\)$", variable["definition"])
                assert selector, variable["definition"]
                rules.append(
                    {"record": f"dashboard:var_{len(rules)}", "expr": substitute(selector[1])}
                )
                where.append(f"{path.name}: variable {variable['name']}")
    rules_file = tmp_path / "dashboard-exprs.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    result = subprocess.run(
        [promtool, "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=60
    )
    if result.returncode != 0:
        # promtool names the rule index that failed: map it back to the panel.
        indexes = [int(i) for i in re.findall(r"rule (\d+)", result.stdout + result.stderr)]
        culprits = [where[i - 1] for i in indexes if 0 < i <= len(where)]
        pytest.fail(
            f"invalid PromQL in {culprits or 'a dashboard'}:\n{result.stdout}{result.stderr}"
        )


class TestProvisioning:
    def test_datasources_have_unique_uids(self) -> None:
        uids = [ds["uid"] for ds in provisioned_datasources()]
        assert len(set(uids)) == len(uids), uids

    def test_prometheus_exemplars_link_to_a_provisioned_tempo(self) -> None:
        sources = {ds["uid"]: ds for ds in provisioned_datasources()}
        prometheus = [ds for ds in sources.values() if ds["type"] == "prometheus"]
        assert prometheus, "no Prometheus datasource provisioned"
        for ds in prometheus:
            links = ds.get("jsonData", {}).get("exemplarTraceIdDestinations", [])
            assert links, f"{ds['name']}: no exemplar link"
            for link in links:
                assert link["name"] == "trace_id", "the exemplar label the proxy writes"
                assert sources[link["datasourceUid"]]["type"] == "tempo"

    def test_one_default_datasource(self) -> None:
        assert sum(bool(ds.get("isDefault")) for ds in provisioned_datasources()) == 1

    def test_dashboard_provider_reads_files(self) -> None:
        paths = sorted((PROVISIONING / "dashboards").glob("*.y*ml"))
        assert paths
        for path in paths:
            config = yaml.safe_load(path.read_text())
            assert config["apiVersion"] == 1
            for provider in config["providers"]:
                assert provider["type"] == "file"
                assert provider["options"]["path"].startswith("/")


def test_each_label_gets_a_variable_and_a_matcher_on_the_metrics_that_carry_it() -> None:
    from proxy.dashboard import labelled_metrics

    dashboard = load(LABELLED)
    names = [v["name"] for v in dashboard["templating"]["list"]]
    assert names[names.index("endpoint") + 1 :][:2] == ["team", "app"]
    carrying = labelled_metrics()
    assert "tokenprobe_requests_total" in carrying
    assert "tokenprobe_requests_in_flight" not in carrying  # no attribution labels there
    filtered = 0
    for panel, target in iter_targets(dashboard):
        expr = target["expr"]
        for match in re.finditer(r"(tokenprobe_\w+?)(_bucket|_sum|_count)?\{([^}]*)\}", expr):
            metric, inside = match.group(1), match.group(3)
            if metric in carrying and 'endpoint=~"$endpoint"' in inside:
                assert 'team=~"$team", app=~"$app"' in inside, f"{panel['title']!r}: {expr}"
                filtered += 1
            else:
                assert "$team" not in inside, f"{panel['title']!r}: {expr}"
    assert filtered > 40


def test_tokenprobe_dashboard_writes_it_and_refuses_a_secret_header() -> None:
    import sys

    args = [sys.executable, "-m", "proxy", "dashboard"]
    labels = ["--label-header", "x-team=team", "--label-header", "x-app=app"]
    out = subprocess.run([*args, *labels], cwd=ROOT, capture_output=True, check=True)
    assert json.loads(out.stdout) == load(LABELLED)
    refused = subprocess.run([*args, "--label-header", "cookie=c"], cwd=ROOT, capture_output=True)
    assert refused.returncode == 2 and b"never becomes a label" in refused.stderr


def test_tokenprobe_dashboard_replaces_its_input_in_place_from_any_folder(tmp_path: Path) -> None:
    import shutil
    import sys

    labels = ["--label-header", "x-team=team", "--label-header", "x-app=app"]
    copy = tmp_path / "tokenprobe.json"
    shutil.copyfile(DASHBOARD_DIR / "tokenprobe.json", copy)
    copy.chmod(0o644)  # Grafana's container reads it as another user
    run = [sys.executable, "-m", "proxy", "dashboard"]
    # The documented command: the input is the output, and the folder is not the checkout.
    subprocess.run([*run, str(copy), *labels, "--output", str(copy)], cwd=tmp_path, check=True)
    assert json.loads(copy.read_text()) == load(LABELLED)
    assert copy.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["tokenprobe.json"]  # no temporary left
    # From another folder, the stock dashboard is the checkout's, whatever the working folder.
    out = subprocess.run([*run, *labels], cwd=tmp_path, capture_output=True, check=True)
    assert json.loads(out.stdout) == load(LABELLED)
    # Run again on its own output: refused, and the file is left as it was.
    again = subprocess.run(
        [*run, str(copy), *labels, "-o", str(copy)], cwd=tmp_path, capture_output=True
    )
    assert again.returncode == 2 and b"has a variable app, team already" in again.stderr
    assert json.loads(copy.read_text()) == load(LABELLED)


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ("", b"is empty (did a shell's `> tokenprobe.json` empty it? write with --output)"),
        ("{not json", b"is not JSON"),
        ("[]", b"is not a Grafana dashboard"),
        (None, b"no dashboard at"),
    ],
)
def test_tokenprobe_dashboard_says_what_is_wrong_with_its_input(
    tmp_path: Path, content: str | None, said: bytes
) -> None:
    import sys

    given = tmp_path / "tokenprobe.json"
    if content is not None:
        given.write_text(content)
    run = [sys.executable, "-m", "proxy", "dashboard", str(given), "-o", str(given)]
    out = subprocess.run(run, cwd=tmp_path, capture_output=True)
    assert out.returncode == 2 and said in out.stderr and b"Traceback" not in out.stderr
    assert (given.read_text() if content is not None else None) == content
