"""tokenprobe dashboard: the Grafana dashboard with a variable for each --label-header label.

    tokenprobe dashboard --label-header x-team=team --output grafana/dashboards/tokenprobe.json

reads the stock dashboard (grafana/dashboards/tokenprobe.json of the checkout this package
runs from, whatever the working folder, or the file given), adds one multi-value query
variable per label after `endpoint` (All = `.*`, so series from before the label existed
still show), and adds `LABEL=~"$LABEL"` next to `endpoint=~"$endpoint"` in every selector of
a metric that carries the attribution labels. Which metrics those are is read from the
Prometheus sink itself, so this never drifts from what the proxy exports.

`--output` replaces the file whole once the dashboard is written (a temporary file renamed
over it), so it may be the input itself: the shell's `> FILE` would empty that file before
this command read it. Without `--output` the dashboard goes to standard output.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from proxy.core.slo import Policy
from proxy.settings import SettingsError, label_headers, parse_value
from proxy.sinks.metrics import Metrics
from proxy.sinks.slo import SloMetrics

#: The stock dashboard, beside the package in a checkout (an editable install included); a
#: wheel does not carry it (Grafana reads it from the repository's grafana/ folder).
STOCK = Path(__file__).resolve().parents[1] / "grafana" / "dashboards" / "tokenprobe.json"
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
    if there := sorted({v["name"] for v in variables} & set(labels)):
        raise ValueError(
            f"the dashboard has a variable {', '.join(there)} already: start from the stock one"
        )
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
    parser.add_argument(
        "dashboard", nargs="?", type=Path, default=STOCK, help=f"input (default {STOCK})"
    )
    parser.add_argument(
        "--label-header", action="append", default=None, help="HEADER=LABEL, as for serve"
    )
    parser.add_argument(
        "-o",
        "--output",
        type=Path,
        default=None,
        help="write here, replacing the file once written (it may be the input); "
        "default: standard output",
    )
    args = parser.parse_args(argv)
    try:
        pairs = parse_value("--label-header", ",".join(args.label_header or ()), label_headers)
        labels = tuple(pair.partition("=")[2] for pair in pairs)
        text = json.dumps(with_labels(_read(args.dashboard), labels), indent=2) + "\n"
    except (SettingsError, ValueError) as exc:
        print(f"tokenprobe dashboard: {exc}", file=sys.stderr)
        return 2
    if args.output is None:
        sys.stdout.write(text)
    else:
        _replace(args.output, text)
    return 0


def _read(path: Path) -> dict[str, Any]:
    """The input dashboard, or a ValueError that says what is wrong with it."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        where = " (a wheel does not carry it)" if path == STOCK else ""
        raise ValueError(
            f"no dashboard at {path}{where}: give the path of grafana/dashboards/tokenprobe.json "
            "from tokenprobe's repository"
        ) from None
    if not text.strip():
        raise ValueError(
            f"{path} is empty (did a shell's `> {path.name}` empty it? write with --output)"
        )
    try:
        dashboard = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    if not isinstance(dashboard, dict) or "templating" not in dashboard:
        raise ValueError(f"{path} is not a Grafana dashboard")
    return dashboard


def _replace(path: Path, text: str) -> None:
    """Write `text` to `path` whole or not at all: a temporary file beside it, renamed over it."""
    try:  # mkstemp's file is private: keep the mode of the file replaced (Grafana reads it)
        mode = path.stat().st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.chmod(name, mode)
        os.replace(name, path)
    except BaseException:
        os.unlink(name)
        raise
