"""`--cost-per-hour`: the setting, the exported gauge, and the bench's cost per million tokens.

Hand computation from the simulator's known throughput (the same figures as the promtool
case in deploy/prometheus/tests/tokenprobe-rules.test.yaml): 50 tok/s per stream, 64
output tokens after a 20 ms TTFT, so one request takes 0.02 + 63 / 50 = 1.28 s and
4 streams make 4 * 64 / 1.28 = 200 output tok/s. At 2.5 per hour:
2.5 / (200 * 3600) * 1e6 = 3.4722 per million output tokens.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from proxy.core.pricing import per_million_tokens
from proxy.server.assemble import assemble
from proxy.settings import SettingsError, parse
from tests.conftest import MODEL, Running

COST = 2.5
STREAMS, OUTPUT, TPS, TTFT = 4, 64, 50.0, 0.02
HAND_THROUGHPUT = STREAMS * OUTPUT / (TTFT + (OUTPUT - 1) / TPS)  # 200 tok/s
HAND_COST = COST / (HAND_THROUGHPUT * 3600) * 1e6  # 3.4722 per million output tokens


def test_flag_and_environment_variable_set_cost_and_currency() -> None:
    upstream = ["--upstream", "http://127.0.0.1:9"]
    flags = parse([*upstream, "--cost-per-hour", "2.5", "--currency", "EUR"], {})
    assert flags.cost_per_hour == 2.5
    from_env = parse(upstream, {"TOKENPROBE_COST_PER_HOUR": "4", "TOKENPROBE_CURRENCY": "EUR"})
    assert (from_env.cost_per_hour, from_env.currency) == (4.0, "EUR")
    default = parse(upstream, {})
    assert default.cost_per_hour is None and default.currency == "USD"


@pytest.mark.parametrize("bad", ["-1", "nan", "inf", "cheap"])
def test_a_bad_cost_fails_at_start_naming_the_flag_or_variable(bad: str) -> None:
    with pytest.raises(SettingsError, match="--cost-per-hour"):
        parse(["--cost-per-hour", bad], {})
    with pytest.raises(SettingsError, match="TOKENPROBE_COST_PER_HOUR"):
        parse([], {"TOKENPROBE_COST_PER_HOUR": bad})


def test_the_proxy_exports_its_cost_per_hour_with_the_currency() -> None:
    settings = parse(
        ["--upstream", "http://127.0.0.1:9", "--cost-per-hour", "2.5", "--currency", "EUR"], {}
    )
    app = assemble(settings, {})
    assert app.registry.get_sample_value(
        "tokenprobe_deployment_cost_per_hour", {"currency": "EUR"}
    ) == pytest.approx(2.5)
    without = assemble(parse(["--upstream", "http://127.0.0.1:9"], {}), {})
    assert (
        without.registry.get_sample_value(
            "tokenprobe_deployment_cost_per_hour", {"currency": "USD"}
        )
        is None
    )


def test_cost_per_million_tokens_formula() -> None:
    assert per_million_tokens(3.6, 1.0) == pytest.approx(1000.0)  # 3600 tokens an hour
    assert per_million_tokens(2.5, 200.0) == pytest.approx(3.4722, abs=1e-4)
    assert per_million_tokens(2.5, 0.0) is None


@pytest.mark.alone("the run's throughput is read within 5% of the programmed speed")
def test_bench_reports_cost_per_million_tokens_agreeing_with_the_hand_computation(
    start_sim: Callable[..., Running], tmp_path: Path
) -> None:
    sim = start_sim(ttft=TTFT, tokens_per_second=TPS, output_tokens=OUTPUT)
    out = tmp_path / "cost.json"
    proc = subprocess.run(
        [sys.executable, "-m", "proxy.bench", "--url", sim.url + "/v1", "--model", MODEL,
         "--out", str(out), "--quiet", "--concurrency", str(STREAMS), "--requests", "8",
         "--max-tokens", str(OUTPUT), "--cost-per-hour", str(COST), "--currency", "EUR"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = orjson.loads(out.read_bytes())
    (summary,) = doc["summary"]
    cost = doc["cost"]
    assert (cost["cost_per_hour"], cost["currency"]) == (COST, "EUR")
    figure = cost["per_million_tokens"]["c=4"]
    # Exactly the formula over the run's own aggregate throughput ...
    assert figure["output"] == pytest.approx(COST / (summary["output_throughput"] * 3600) * 1e6)
    input_rate = summary["prompt_tokens"] / summary["duration"]
    assert figure["input"] == pytest.approx(COST / (input_rate * 3600) * 1e6)
    # ... and close to the hand computation from the simulator's programmed speed
    # (the run can only be slower than programmed, so its cost only higher).
    assert round(HAND_COST, 4) == 3.4722
    assert HAND_COST <= figure["output"] < HAND_COST * 1.05
    assert "EUR per 1M tok" in proc.stdout and f"{figure['output']:.3f}" in proc.stdout
