"""`tokenprobe bench compare`: saved runs of the simulator at three decode speeds, and a rerun.

The simulator stands in for three builds of one model: 200 tok/s, 10% slower (180) and
30% slower (140), with the same TTFT; a fourth run repeats the first setting. Each run is
a real `tokenprobe bench` process against a real simulator on loopback.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from proxy.bench.cli import main
from proxy.bench.compare_runs import compare_runs
from proxy.bench.runs import load
from proxy.bench.significance import Change
from proxy.sim.app import create_sim_app
from proxy.sim.config import SimConfig
from tests.conftest import MODEL
from tests.servers import ThreadedServer

pytestmark = pytest.mark.alone(
    "two runs of identical settings must show no significant difference: timing under load"
)

#: The rerun right after the base: the less time between them, the less the machine drifts.
SPEEDS = {"base": 200.0, "rerun": 200.0, "minus10": 180.0, "minus30": 140.0}
#: 48 requests of 0.18 s, 8 at a time: the four runs take about 6 s, all alone.
FLAGS = ("--concurrency", "8", "--requests", "48", "--max-tokens", "32")
#: The TTFT is part of each request's time, so it dilutes the aggregate throughput's change:
#: 10% slower decoding is -7.7% aggregate at 50 ms (0.205 s against 0.222 s a request),
#: near the 5% a verdict needs, and one CI run under load measured -4.8% ("same"). At 20 ms
#: it is -8.9%: measured here -8.9 and -9.2% (at 50 ms -7.5 and -7.6%).
TTFT = 0.02


def _bench(url: str, out: Path, *flags: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "proxy.bench", "--url", url, "--model", MODEL, "--out", str(out),
         "--quiet", *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def _run(name: str, tps: float, out: Path) -> Path:
    """One saved bench run against its own simulator decoding at `tps`."""
    app = create_sim_app(
        SimConfig(models=(MODEL,), ttft=TTFT, tokens_per_second=tps, output_tokens=64)
    )
    server = ThreadedServer(app).start()
    try:
        label = ("--label", f"tps{tps:g}") if name == "base" else ()
        _bench(server.url + "/v1", out, *FLAGS, *label)
    finally:
        server.stop()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    tmp = tmp_path_factory.mktemp("runs")
    yield {name: _run(name, tps, tmp / f"{name}.json") for name, tps in SPEEDS.items()}


def test_decode_10_and_30_percent_slower_are_reported_with_intervals_excluding_zero(
    runs: dict[str, Path],
) -> None:
    (level,) = compare_runs([load(str(runs[n])) for n in ("base", "minus10", "minus30")])
    assert level.runs == ["tps200", "minus10", "minus30"]
    for name, expected in (("minus10", -0.10), ("minus30", -0.30)):
        speed = level.changes[name]["decode_tps_p50"]
        assert speed.change == pytest.approx(expected, abs=0.02)
        assert speed.low is not None and speed.high is not None
        assert speed.high < 0 and speed.verdict == "worse", speed
        tpot = level.changes[name]["tpot_p50"]  # 1/0.9 - 1 = +11%, 1/0.7 - 1 = +43%
        assert tpot.change == pytest.approx(1 / (1 + expected) - 1, abs=0.03)
        assert tpot.low is not None and tpot.low > 0 and tpot.verdict == "worse", tpot
        aggregate = level.changes[name]["output_tps"]
        assert aggregate.high is not None and aggregate.high < 0 and aggregate.verdict == "worse"


def _called(base: Path, rerun: Path) -> dict[str, Change]:
    """The figures compare calls different (worse or better) between two saved runs."""
    (level,) = compare_runs([load(str(base)), load(str(rerun))])
    return {n: c for n, c in level.changes[rerun.stem].items() if c.verdict not in ("same", "n/a")}


def test_two_runs_of_identical_settings_show_no_significant_difference(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """A pair is rerun, as the operators' guide tells a reader to, when one figure is called.

    The interval covers request-to-request noise, not the machine's drift between two runs:
    a CI run called the rerun's TTFT p50 worse by 5.6% (21.4 against 22.6 ms, 1.2 ms of a
    loaded machine). Drift is rarely the same twice; a compare that calls noise a change
    calls it in every pair, and fails here."""
    calls = [_called(runs["base"], runs["rerun"])]
    for attempt in range(2):
        if not calls[-1]:
            break
        pair = tmp_path / str(attempt)
        pair.mkdir()
        base, rerun = (
            _run(name, SPEEDS[name], pair / f"{name}.json") for name in ("base", "rerun")
        )
        calls.append(_called(base, rerun))
    assert not calls[-1], calls


def test_the_table_names_each_run_and_its_change_with_the_interval(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    plot = tmp_path / "overlay.png"
    paths = [str(runs[n]) for n in ("base", "minus10", "minus30")]
    assert main(["compare", *paths, "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "level c=8 (baseline tps200)" in out
    row = next(line for line in out.splitlines() if line.startswith("per-stream decode p50"))
    assert "minus10" not in row and row.count("worse") == 2, row
    assert plot.stat().st_size > 10_000


def test_fail_if_worse_exits_1_on_the_30_percent_run_and_0_on_the_rerun(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    base = str(runs["base"])
    gate = ["--fail-if-worse", "20", "--metric", "tpot_p50"]
    assert main(["compare", base, str(runs["minus30"]), *gate]) == 1
    assert "regression: c=8: minus30 TPOT p50 +4" in capsys.readouterr().err
    assert main(["compare", base, str(runs["rerun"]), *gate]) == 0
    # The 10% run is worse, but not by more than 20%: it passes this gate.
    assert main(["compare", base, str(runs["minus10"]), *gate]) == 0


def test_runs_with_different_settings_are_refused_naming_the_difference(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    other = tmp_path / "other.json"
    doc = orjson.loads(runs["rerun"].read_bytes())
    doc["config"]["max_tokens"] = 64
    doc["config"]["model"] = "another-model"
    other.write_bytes(orjson.dumps(doc))
    assert main(["compare", str(runs["base"]), str(other)]) == 2
    err = capsys.readouterr().err
    assert "not comparable" in err
    assert "model: tps200 has 'sim-model', other has 'another-model'" in err
    assert "max tokens: tps200 has 32, other has 64" in err
    assert main(["compare", str(runs["base"]), str(other), "--force"]) == 0
    assert "warning: max tokens" in capsys.readouterr().err


def test_different_prompts_are_refused(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    other = tmp_path / "prompts.json"
    doc = orjson.loads(runs["rerun"].read_bytes())
    doc["config"]["prompts_sha256"] = "0" * 64
    other.write_bytes(orjson.dumps(doc))
    assert main(["compare", str(runs["base"]), str(other)]) == 2
    assert "prompts differ" in capsys.readouterr().err


def test_a_run_is_labelled_by_its_flag_else_its_file_name(runs: dict[str, Path]) -> None:
    assert load(str(runs["base"])).label == "tps200"
    assert load(str(runs["rerun"])).label == "rerun"


def test_the_bootstrap_is_seeded_so_the_same_files_give_the_same_intervals(
    runs: dict[str, Path],
) -> None:
    files = [load(str(runs[n])) for n in ("base", "minus10")]
    first, second = compare_runs(files, rounds=300), compare_runs(files, rounds=300)
    assert first[0].changes == second[0].changes


def _records(n: int, ttft: float, failed: int = 0, length: int = 0) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for i in range(n):
        ok = i >= failed
        out.append({
            "error_type": None if ok else "upstream_error",
            "ttft": ttft * (1 + (i % 7) / 100) if ok else None,
            "tpot": 0.01 if ok else None, "e2e": 0.5, "decode_tokens_per_second": 100.0,
            "output_tokens": 32 if ok else 0,
            "finish_reason": "length" if ok and i < failed + length else "stop",
        })  # fmt: skip
    return out


def test_shares_change_in_points_and_goodput_follows_the_slo() -> None:
    from proxy.bench.significance import compare, rows

    slo = {"ttft": 0.15}
    base = rows(_records(200, 0.1), slo)
    worse = rows(_records(200, 0.2, failed=30, length=20), slo)
    result = compare(base, 10.0, worse, 10.0, has_slo=True, rounds=500)
    errors = result["error_share"]
    assert errors.change == pytest.approx(0.15) and errors.verdict == "worse"
    assert result["length_share"].change == pytest.approx(20 / 170)
    assert result["goodput"].base == pytest.approx(20.0) and result["goodput"].value == 0.0
    assert result["ttft_p50"].verdict == "worse" and result["ttft_p95"].low is not None


def test_attainment_is_compared_in_points_of_the_share_that_met_every_target() -> None:
    from proxy.bench.significance import compare, rows

    slo = {"ttft": 0.15}
    base = rows(_records(200, 0.1), slo)  # every request within 0.15 s
    # 100 of 200 fail: the other 100 are within the target, so half met it.
    half = rows(_records(200, 0.1, failed=100), slo)
    result = compare(base, 10.0, half, 10.0, has_slo=True, rounds=300)["attainment"]
    assert (result.base, result.value) == (1.0, 0.5)
    assert result.change == pytest.approx(-0.5) and result.verdict == "worse"
    no_slo = compare(rows(_records(50, 0.1), {}), 5.0, rows(_records(50, 0.1), {}), 5.0,
                     has_slo=False, rounds=50)  # fmt: skip
    assert no_slo["attainment"].verdict == "n/a" and no_slo["attainment"].base is None


def test_a_p95_gets_no_interval_from_fewer_than_100_requests() -> None:
    from proxy.bench.significance import compare, rows

    result = compare(rows(_records(99, 0.1), {}), 5.0, rows(_records(99, 0.3), {}), 5.0,
                     has_slo=False, rounds=200)  # fmt: skip
    assert result["ttft_p95"].verdict == "n/a" and result["ttft_p95"].low is None
    assert result["ttft_p50"].verdict == "worse"
    assert result["goodput"].verdict == "n/a"  # no --slo, no goodput


def test_failures_that_held_their_slot_widen_the_throughput_interval() -> None:
    """A failure that took as long as a success gave no tokens for its time: how many
    there are is uncertain, and so is the throughput. Timed over successes alone, a
    resample's throughput never moved with that share: an interval of no width."""
    from proxy.bench.significance import compare, rows

    base = rows(_records(400, 0.1), {})
    failing = rows(_records(400, 0.1, failed=40), {})  # e2e 0.5 s each, failed or not
    result = compare(base, 10.0, failing, 10.0, has_slo=False, rounds=500)["output_tps"]
    assert result.change == pytest.approx(-0.10)
    assert result.low is not None and result.high is not None
    assert result.low < -0.11 and -0.09 < result.high < 0, result
