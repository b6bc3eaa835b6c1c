"""The Prometheus rules in deploy/prometheus: promtool accepts them and their unit tests pass.

promtool comes from Debian's `prometheus` package; without it these tests skip, except
under CI=true, where they fail (CI installs it).
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.paths import ROOT
from tests.prom import require_binary

PROMETHEUS = ROOT / "deploy" / "prometheus"
RULE_FILES = sorted((PROMETHEUS / "rules").glob("*.yaml"))
RULE_TESTS = sorted((PROMETHEUS / "tests").glob("*.yaml"))
CONFIGS = sorted(PROMETHEUS.glob("prometheus*.yml"))
SEVERITIES = {"page", "critical", "ticket", "warning"}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require_binary("promtool"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=PROMETHEUS,
    )


def rules(kind: str) -> list[dict[str, Any]]:
    found = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            found.extend(rule for rule in group["rules"] if kind in rule)
    return found


def test_rule_files_pass_promtool_check() -> None:
    assert RULE_FILES
    result = promtool("check", "rules", *map(str, RULE_FILES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_rule_unit_tests_pass() -> None:
    assert RULE_TESTS
    # One promtool a file, side by side: each evaluates its series on one core, for
    # seconds (the recording rules' and the SLO's files take 3-4 s of CPU each).
    with ThreadPoolExecutor(len(RULE_TESTS)) as pool:
        results = list(pool.map(lambda test: promtool("test", "rules", str(test)), RULE_TESTS))
    failed = [r.stdout + r.stderr for r in results if r.returncode != 0]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_prometheus_config_passes_promtool_check(config: Path) -> None:
    result = promtool("check", "config", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    found = f"SUCCESS: {len(RULE_FILES)} rule files found"
    assert found in result.stdout, "config must load every rule file"


def test_every_alert_has_severity_and_advice() -> None:
    for alert in rules("alert"):
        name = alert["alert"]
        assert alert.get("labels", {}).get("severity") in SEVERITIES, name
        annotations = alert.get("annotations", {})
        for key in ("summary", "description", "advice"):
            assert len(annotations.get(key, "")) >= 20, f"{name}: annotation {key}"


def test_the_panels_and_rows_an_alert_names_are_on_the_dashboard() -> None:
    # "Open the 'Errors by type' panel", "the 'Client-seen vs vLLM' row": an operator
    # paged at night looks for exactly that title.
    def titles(panels: list[dict[str, Any]]) -> set[str]:
        found = set()
        for panel in panels:
            found.add(panel.get("title", ""))
            found |= titles(panel.get("panels", []))
        return found

    dashboard = ROOT / "grafana" / "dashboards" / "tokenprobe.json"
    on_dashboard = titles(json.loads(dashboard.read_text())["panels"])
    named = 0
    for alert in rules("alert"):
        advice = alert["annotations"]["advice"]
        if re.search(r"\b(?:panels?|row)\b", advice):
            for title in re.findall(r"(?<!\w)'([^']+)'(?!\w)", advice):
                assert title in on_dashboard, f"{alert['alert']}: no panel or row {title!r}"
                named += 1
    assert named >= 3


def test_every_alert_is_shown_firing_by_a_unit_test() -> None:
    fired = set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                if check.get("exp_alerts"):
                    fired.add(check["alertname"])
    untested = sorted({a["alert"] for a in rules("alert")} - fired)
    assert not untested, f"no unit test makes these fire: {untested}"


def test_auth_and_context_length_have_their_own_alerts() -> None:
    exprs = {a["alert"]: a["expr"] for a in rules("alert")}
    assert 'error_type="auth"' in exprs["TokenprobeAuthErrors"]
    assert 'error_type="context_length"' in exprs["TokenprobeContextLengthErrors"]
    # ...and the generic by-type alert leaves them to those.
    assert "auth|context_length" in exprs["TokenprobeErrorRatioHigh"]


def test_recorded_series_used_by_alerts_are_recorded() -> None:
    recorded = {r["record"] for r in rules("record")}
    for alert in rules("alert"):
        for token in alert["expr"].replace("{", " ").replace("(", " ").split():
            if token.count(":") == 2 and not token.startswith("vllm:"):
                assert token in recorded, f"{alert['alert']} reads {token}, never recorded"


def test_every_generative_endpoint_list_names_every_generative_api() -> None:
    """The truncation ratio (rules, alert, dashboard) selects the generative APIs by an
    endpoint regex: one missing there is never counted (Ollama's /api/chat and
    /api/generate were left out, so their cut answers never reached the alert)."""
    import re

    from proxy.core.apis import ENDPOINTS, api_of

    generative = {endpoint for endpoint in ENDPOINTS if api_of(endpoint).generative}
    texts = [path.read_text() for path in RULE_FILES]
    texts.append((ROOT / "grafana" / "dashboards" / "tokenprobe.json").read_text())
    lists = [
        set(found.split("|"))
        for text in texts
        for found in re.findall(r'endpoint=~\\?"([^"\\]+)\\?"', text)
        if "/v1/chat/completions" in found and "/v1/completions" in found
    ]
    assert len(lists) >= 8, lists  # the rules' six and the dashboard's
    for endpoints in lists:
        assert endpoints == generative, endpoints ^ generative


def test_the_dashboards_page_has_one_row_per_alert() -> None:
    """docs/dashboards.md's alerts table names every alert the rule files define, and no
    other: TokenprobeUpstreamProtocolErrors was in the rules and in no doc."""
    page = (ROOT / "docs" / "dashboards.md").read_text()
    table = page.split("\n## Alerts", 1)[1].split("\n\n", 2)[1]
    named = set()
    for row in table.splitlines():
        if row.startswith("| `"):
            named |= set(re.findall(r"`(Tokenprobe\w+)`", row.split(" | ", 1)[0]))
    assert named == {a["alert"] for a in rules("alert")}, "add the alert's row, or remove it"


# --- Names, thresholds and the pages that describe them ------------------------------

DASHBOARD = ROOT / "grafana" / "dashboards" / "tokenprobe.json"
#: A label that states the value's unit, not a level it was aggregated to.
UNIT_LABELS = {"currency"}
_AGGREGATION = re.compile(r"(?<![\w:])(?:sum|max|min|avg|count)\s*(?:by\s*\(([^)]*)\)\s*)?\(")
_RECORDED = re.compile(r"(?<![\w:])[a-z][a-z_]*:[a-z0-9_]+:[a-z0-9_]+")
_REPLACED = re.compile(r'label_replace\(.*?,\s*"(\w+)",\s*"[^"]*",\s*"[^"]*",\s*"[^"]*"\s*\)', re.S)


def output_labels(expr: str, levels: dict[str, set[str]]) -> set[str]:
    """The labels a rule's result keeps: those of the aggregations no other aggregation
    encloses (`le` is histogram_quantile's), of label_replace, and of the recorded series
    read outside any aggregation."""
    labels: set[str] = set()
    stack: list[bool] = []  # per open parenthesis: does it hold an aggregation's argument
    i = 0
    while i < len(expr):
        inside = any(stack)
        if aggregation := _AGGREGATION.match(expr, i):
            if not inside and aggregation[1]:
                labels |= {label.strip() for label in aggregation[1].split(",")} - {"le"}
            stack.append(True)
            i = aggregation.end()
        elif replaced := _REPLACED.match(expr, i):
            if not inside:
                labels.add(replaced[1])
            stack.append(False)
            i += len("label_replace(")
        elif recorded := _RECORDED.match(expr, i):
            if not inside:
                labels |= levels[recorded[0]]
            i = recorded.end()
        else:
            if expr[i] == "(":
                stack.append(False)
            elif expr[i] == ")":
                stack.pop()
            i += 1
    return labels


def test_a_recording_rules_level_names_exactly_the_labels_it_keeps() -> None:
    """level:metric:operations (https://prometheus.io/docs/practices/rules/): a ratio
    summed `by (job, model)` is job_model:..., not model:..., or a reader joins it on the
    wrong labels."""
    levels: dict[str, set[str]] = {}
    for rule in rules("record"):
        name, expr = rule["record"], rule["expr"]
        kept = output_labels(expr, levels) - UNIT_LABELS
        level = name.split(":", 1)[0]
        spelled = {"_".join(order) for order in itertools.permutations(sorted(kept))}
        assert level in spelled, f"{name} keeps {sorted(kept)}: name it {sorted(spelled)[0]}:..."
        levels.setdefault(name, kept)


def test_recorded_series_the_dashboard_reads_are_recorded() -> None:
    recorded = {r["record"] for r in rules("record")}
    read = set(_RECORDED.findall(DASHBOARD.read_text())) - {
        name for name in _RECORDED.findall(DASHBOARD.read_text()) if name.startswith("vllm:")
    }
    assert read and read <= recorded, read - recorded


def test_a_panel_that_names_its_alert_turns_red_at_the_alerts_threshold() -> None:
    """'Context-length errors' turned red at 5% while its alert fires at 2%."""
    thresholds = {}
    for alert in rules("alert"):
        found = {float(v) for v in re.findall(r">\s*([\d.]+)\s*(?:$|\n|and|or)", alert["expr"])}
        if len(found) == 1:
            thresholds[alert["alert"]] = found.pop()
    checked = 0
    top = json.loads(DASHBOARD.read_text())["panels"]
    for panel in [*top, *(inner for row in top for inner in row.get("panels", []))]:
        named = re.search(r"Alert: (Tokenprobe\w+)", panel.get("description", ""))
        if not named or named[1] not in thresholds:
            continue
        config = panel["fieldConfig"]
        ratios = [config["defaults"]] if config["defaults"].get("unit") == "percentunit" else []
        for override in config.get("overrides", []):
            properties = {p["id"]: p["value"] for p in override["properties"]}
            if properties.get("unit") == "percentunit":
                ratios.append(properties)
        assert ratios, f"{panel['title']!r}: no ratio to colour"
        for ratio in ratios:
            red = ratio["thresholds"]["steps"][-1]["value"]
            assert red == thresholds[named[1]], f"{panel['title']!r}: red at {red}, {named[1]}"
            checked += 1
    assert checked >= 3


def test_the_dashboards_page_describes_every_row() -> None:
    page = (ROOT / "docs" / "dashboards.md").read_text()
    shown = page.split("\n## What the dashboard shows", 1)[1].split("\n## ", 1)[0]
    described = re.findall(r"^- \*\*([^*]+)\*\*", shown, re.M)
    rows = [p["title"] for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] == "row"]
    missing = [row for row in rows if not any(row.startswith(d) for d in described)]
    assert not missing, f"docs/dashboards.md does not describe the rows {missing}"
