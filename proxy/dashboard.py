"""tokenprobe dashboard: the Grafana dashboard with a variable for each --label-header label.

    tokenprobe dashboard --label-header x-team=team > grafana/dashboards/tokenprobe.json

reads the stock dashboard (grafana/dashboards/tokenprobe.json, or the file given), adds one
multi-value query variable per label after `endpoint` (All = `.*`, so series from before the
label existed still show), and adds `LABEL=~"$LABEL"` next to `endpoint=~"$endpoint"` in
every selector of a metric that carries the attribution labels. Which metrics those are is
read from the Prometheus sink itself, so this never drifts from what the proxy exports.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from proxy.core.slo import Policy
from proxy.settings import SettingsError, label_headers, parse_value
from proxy.sinks.metrics import Metrics
from proxy.sinks.slo import SloMetrics

STOCK = Path("grafana/dashboards/tokenprobe.json")
_ENDPOINT = 'endpoint=~"$endpoint"'


def labelled_metrics() -> frozenset[str]:
    """Prometheus sample-name prefixes of the metrics that carry the attribution labels."""
    probe = "tokenprobe_attribution_probe"
    registry = CollectorRegistry()
    metrics = Metrics(registry, (probe,))
    slo = SloMetrics(registry, Policy(), (probe,))
    names = set()
    for value in [*vars(metrics).values(), *vars(slo).values()]:
        if probe in getattr(value, "_labelnames", ()):
            name = value._name
            names.add(name + "_total" if value._type == "counter" else name)
    return frozenset(names)


def with_labels(dashboard: dict[str, Any], labels: tuple[str, ...]) -> dict[str, Any]:
    """A copy of the dashboard with a variable and a matcher for each label."""
    out = copy.deepcopy(dashboard)
    variables = out["templating"]["list"]
    at = next(i for i, v in enumerate(variables) if v["name"] == "endpoint") + 1
    variables[at:at] = [_variable(label) for label in labels]
    names = "|".join(sorted(map(re.escape, labelled_metrics()), key=len, reverse=True))
    # A selector of one of those metrics (histogram parts included) with the endpoint matcher.
    selector = re.compile(rf"\b({names})(_bucket|_sum|_count)?\{{([^}}]*)\}}")
    matchers = "".join(f', {label}=~"${label}"' for label in labels)

    def add(match: re.Match[str]) -> str:
        inside = match.group(3)
        if _ENDPOINT not in inside:
            return match.group(0)
        inside = inside.replace(_ENDPOINT, _ENDPOINT + matchers, 1)
        return f"{match.group(1)}{match.group(2) or ''}{{{inside}}}"

    for panel in _panels(out):
        for target in panel.get("targets", []):
            target["expr"] = selector.sub(add, target["expr"])
    out["panels"].extend(_attainment_by(out, labels))
    return out


#: The SLO row's attainment panel, and where one copy per label goes (panel ids 330-339).
_ATTAINMENT, _BY_LABEL_ID = 301, 330


def _attainment_by(dashboard: dict[str, Any], labels: tuple[str, ...]) -> list[dict[str, Any]]:
    """Attainment by each --label-header label (by team, by app): the by-model panel with
    the label as its grouping, placed below the SLO row's panels."""
    source = next((p for p in _panels(dashboard) if p.get("id") == _ATTAINMENT), None)
    if source is None:
        return []
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dashboard["panels"])
    panels = []
    for i, label in enumerate(labels[:10]):
        panel = copy.deepcopy(source)
        panel["id"] = _BY_LABEL_ID + i
        panel["title"] = f"SLO attainment by {label}"
        panel["description"] = source["description"].replace("Share of", f"By {label}: share of")
        panel["gridPos"] = {"h": 8, "w": 8, "x": 8 * (i % 3), "y": bottom + 8 * (i // 3)}
        for target in panel["targets"]:
            target["expr"] = target["expr"].replace("by (model)", f"by ({label})")
            target["legendFormat"] = "{{" + label + "}}"
        panels.append(panel)
    return panels


def _variable(label: str) -> dict[str, Any]:
    query = (
        f'label_values(tokenprobe_requests_total{{model=~"$model", endpoint=~"$endpoint"}}, '
        f"{label})"
    )
    return {
        "name": label,
        "label": label,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {
            "qryType": 1,
            "query": query,
            "refId": "PrometheusVariableQueryEditor-VariableQuery",
        },
        "definition": query,
        "refresh": 2,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "options": [],
        "regex": "",
        "sort": 1,
        "hide": 0,
    }


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for panel in dashboard.get("panels", []):
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tokenprobe dashboard", description=__doc__.split("\n")[0]
    )
    parser.add_argument("dashboard", nargs="?", default=str(STOCK), help=f"input (default {STOCK})")
    parser.add_argument(
        "--label-header", action="append", default=None, help="HEADER=LABEL, as for serve"
    )
    args = parser.parse_args(argv)
    try:
        pairs = parse_value("--label-header", ",".join(args.label_header or ()), label_headers)
    except SettingsError as exc:
        print(f"tokenprobe dashboard: {exc}", file=sys.stderr)
        return 2
    dashboard = json.loads(Path(args.dashboard).read_text())
    labels = tuple(pair.partition("=")[2] for pair in pairs)
    sys.stdout.write(json.dumps(with_labels(dashboard, labels), indent=2) + "\n")
    return 0
