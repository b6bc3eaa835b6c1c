"""The Prometheus rules in deploy/prometheus: promtool accepts them and their unit tests pass.

promtool comes from Debian's `prometheus` package; without it these tests skip, except
under CI=true, where they fail (CI installs it).
"""

from __future__ import annotations

import json
import re
import subprocess
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
    result = promtool("test", "rules", *map(str, RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


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
