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
                # the folder comes from Grafana's environment, as each stack sets it
                # (an absolute path: tests/deploy/test_grafana_env.py)
                assert provider["options"]["path"] == "${DASHBOARDS_PATH}"


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


# --- What the panels draw agrees with what they say ---------------------------------


def _stock() -> dict[str, Any]:
    return load(DASHBOARD_DIR / "tokenprobe.json")


def _panel(title: str) -> dict[str, Any]:
    (panel,) = [p for p in iter_panels(_stock()) if p.get("title") == title]
    return panel


def _seconds(interval: str) -> float:
    value, unit = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", interval).groups()  # type: ignore[union-attr]
    return float(value) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]


#: Prometheus scrapes the proxy every 15 s (deploy/prometheus/prometheus*.yml).
SCRAPE_INTERVAL_S = 15


def test_heatmaps_count_each_observation_once() -> None:
    """A heatmap's cells are one step wide. increase() over a window wider than the step
    (sum by (le) (increase(x_bucket[$__rate_interval])) at step $__interval) counts each
    request in every cell whose window holds it: 4 cells at a 1 h range. Either the window
    is the step ($__interval, at least two scrapes wide), or the cells are a rate per
    second and say so."""
    heatmaps = [p for p in iter_panels(_stock()) if p["type"] == "heatmap"]
    assert heatmaps
    for panel in heatmaps:
        for target in panel["targets"]:
            expr = target["expr"]
            for window in re.findall(r"\bincrease\([^\[]*\[([^\]]+)\]", expr):
                assert window == "$__interval", f"{panel['title']!r}: increase over [{window}]"
                minimum = panel.get("interval", "")
                assert minimum and _seconds(minimum) >= 2 * SCRAPE_INTERVAL_S, panel["title"]
            if re.search(r"\brate\(", expr):
                unit = panel["options"].get("cellValues", {}).get("unit")
                assert unit in {"reqps", "ops"}, f"{panel['title']!r}: cells are a rate, {unit}"
                assert "per second" in panel["description"], panel["title"]


def test_quantiles_named_are_the_quantiles_drawn() -> None:
    """A panel that says p50/p95/p99 draws those three, no more, no fewer."""
    checked = 0
    for panel in iter_panels(_stock()):
        exprs = " ".join(t["expr"] for t in panel.get("targets", []))
        drawn = {
            str(round(float(q) * 100)) for q in re.findall(r"histogram_quantile\(([\d.]+)", exprs)
        }
        named = set(re.findall(r"\bp(\d\d)\b", f"{panel['title']} {panel.get('description')}"))
        if drawn and named:
            assert named == drawn, f"{panel['title']!r}: says p{sorted(named)}, draws {drawn}"
            checked += 1
    assert checked >= 10


def test_the_token_source_panel_names_every_source() -> None:
    from proxy.core.measurement import TokenSource

    description = _panel("Where token counts come from")["description"]
    for source in TokenSource:
        if source is not TokenSource.NONE:  # no tokens to count
            assert f"{source.value}:" in description, source.value


def test_the_missed_target_panel_names_every_slo_target_in_order() -> None:
    from proxy.core.slo import NAMES

    description = _panel("Which target is missed most")["description"]
    assert f"in the order {', '.join(NAMES)}" in description


def test_panels_whose_queries_ignore_the_model_filter_say_so() -> None:
    # The Conversations row's per-conversation histograms have no model label.
    for panel in iter_panels(_stock()):
        if panel["type"] == "row":
            continue
        if not any("$model" in t["expr"] for t in panel["targets"]):
            said = re.search(
                r"model (?:and endpoint )?filters? do(?:es)? not apply", panel["description"]
            )
            assert said, f"{panel['title']!r}: say that the model filter does not apply"


def test_request_ratios_show_no_nan_when_idle() -> None:
    """A ratio over requests with no requests in its window is 0/0 = NaN: a stat panel
    shows "NaN", a graph a broken line. Keep the denominator only above 0."""
    checked = 0
    for panel, target in iter_targets(_stock()):
        parts = re.split(r"\)\s*/\s*(?=\(?\s*sum)", target["expr"])
        if len(parts) < 2 or "requests_total" not in parts[-1]:
            continue
        assert re.search(r"\)\s*>\s*0\s*\)\s*$", parts[-1]), f"{panel['title']!r} {target['refId']}"
        checked += 1
    assert checked >= 6


def test_the_decode_speed_heatmap_counts_one_request_once(tmp_path: Path) -> None:
    """One request at 25 tokens/s, observed between two scrapes: the cells of its bucket
    over time hold one request in all (a rate's cells times their width). The increase()
    over $__rate_interval it drew held 4, one in each cell whose window reached it."""
    promtool = require_binary("promtool")
    panel = _panel("Decode speed per request (tokens/s)")
    (target,) = panel["targets"]
    step = _seconds(BUILTIN_VARIABLES["__interval"])
    per_second = panel["options"]["cellValues"]["unit"] == "reqps"
    cells = f"(({substitute(target['expr'])}){f' * {step:g}' if per_second else ''})"
    metric = "tokenprobe_request_decode_tokens_per_second_bucket"
    labels = 'model="m", endpoint="/v1/chat/completions"'
    test = {
        "rule_files": ["empty.yaml"],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",  # the scrape interval: the request is seen at the 5m scrape
                "input_series": [
                    {"series": f'{metric}{{{labels}, le="20.0"}}', "values": "0x40"},
                    {"series": f'{metric}{{{labels}, le="30.0"}}', "values": "0x19 1x20"},
                    {"series": f'{metric}{{{labels}, le="+Inf"}}', "values": "0x19 1x20"},
                ],
                "promql_expr_test": [
                    {
                        "expr": f"sum_over_time({cells}[10m:{step:g}s])",
                        "eval_time": "10m",
                        "exp_samples": [
                            {"labels": '{le="20.0"}', "value": 0},
                            {"labels": '{le="30.0"}', "value": 1},
                            {"labels": '{le="+Inf"}', "value": 1},
                        ],
                    }
                ],
            }
        ],
    }
    (tmp_path / "empty.yaml").write_text("groups: []\n")
    (tmp_path / "heatmap.test.yaml").write_text(yaml.safe_dump(test))
    result = subprocess.run(
        [promtool, "test", "rules", "heatmap.test.yaml"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
