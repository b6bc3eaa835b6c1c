"""`tokenprobe bench compare` on records made up here: which changes it may call, and when
a candidate fails the `--fail-if-worse` gate."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest

from proxy.bench.cli import main
from proxy.bench.significance import MIN_REQUESTS, Row, compare, rows

LEVEL = "c=4"


def records(n: int, ttft: float, failed: int = 0) -> list[dict[str, object]]:
    """n requests of one level, 1% apart in TTFT; the first `failed` of them failed."""
    out: list[dict[str, object]] = []
    for i in range(n):
        ok = i >= failed
        out.append({
            "level": LEVEL, "error_type": None if ok else "auth",
            "ttft": ttft * (1 + i / 100) if ok else None, "tpot": 0.01 if ok else None,
            "e2e": ttft + 0.1, "decode_tokens_per_second": 100.0 if ok else None,
            "output_tokens": 10 if ok else 0, "finish_reason": "length" if ok else None,
        })  # fmt: skip
    return out


def run_file(path: Path, label: str, recs: list[dict[str, object]]) -> str:
    config = {"model": "m", "endpoint": "/v1/chat/completions", "mode": "closed", "label": label}
    summary = [{"label": LEVEL, "value": 4, "duration": 2.0}]
    doc = {"tool": "tokenprobe bench", "config": config, "summary": summary, "records": recs}
    path.write_bytes(orjson.dumps(doc))
    return str(path)


def test_a_candidate_whose_every_request_failed_fails_the_gate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = run_file(tmp_path / "base.json", "base", records(40, 0.1))
    broken = run_file(tmp_path / "broken.json", "broken", records(40, 0.1, failed=40))
    assert main(["compare", base, broken, "--fail-if-worse", "5"]) == 1
    assert "regression: c=4: broken has no TTFT p50" in capsys.readouterr().err


def test_a_candidate_as_good_as_the_baseline_passes_the_gate(tmp_path: Path) -> None:
    base = run_file(tmp_path / "base.json", "base", records(40, 0.1))
    rerun = run_file(tmp_path / "rerun.json", "rerun", records(40, 0.1))
    assert main(["compare", base, rerun, "--fail-if-worse", "5"]) == 0


def ok_rows(n: int, ttft: float) -> list[Row]:
    return rows(records(n, ttft), {})


@pytest.mark.parametrize("n", [1, 2, 3, MIN_REQUESTS - 1])
def test_no_figure_gets_an_interval_from_fewer_than_min_requests(n: int) -> None:
    """10% slower TTFT from n requests a run: a 95% bootstrap interval from 1-3 values
    excludes 0 where an exact rank test cannot reject at all."""
    result = compare(ok_rows(n, 0.1), 1.0, ok_rows(n, 0.11), 1.0, has_slo=False, rounds=300)
    for name in ("ttft_p50", "tpot_p50", "output_tps", "error_share"):
        change = result[name]
        assert change.verdict == "n/a" and change.low is None, change
        assert change.reason == f"from {n} requests, an interval needs {MIN_REQUESTS}", change


def test_a_latency_counts_only_the_requests_that_succeeded() -> None:
    """40 requests of which 3 succeeded: the TTFT p50 comes from 3 values."""
    base, few = rows(records(40, 0.1), {}), rows(records(40, 0.2, failed=37), {})
    result = compare(base, 1.0, few, 1.0, has_slo=False, rounds=300)
    assert result["ttft_p50"].reason == f"from 3 requests, an interval needs {MIN_REQUESTS}"
    assert result["error_share"].verdict == "worse"


def test_min_requests_a_run_give_intervals_and_verdicts() -> None:
    n = MIN_REQUESTS
    result = compare(ok_rows(n, 0.1), 1.0, ok_rows(n, 0.2), 1.0, has_slo=False, rounds=300)
    assert result["ttft_p50"].verdict == "worse" and result["ttft_p50"].reason is None


def test_the_table_says_why_a_change_has_no_interval(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = run_file(tmp_path / "base.json", "base", records(3, 0.1))
    slower = run_file(tmp_path / "slower.json", "slower", records(3, 0.2))
    assert main(["compare", base, slower]) == 0
    assert f"[n/a: from 3 requests, an interval needs {MIN_REQUESTS}]" in capsys.readouterr().out


def test_the_table_columns_stay_aligned_beside_n_a_and_interval_cells(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """40 requests a run: TTFT p50 has an interval, TTFT p95 "[n/a: ... needs 100]", a
    longer cell; every run's value, and every change, ends in one column all the same."""
    base = run_file(tmp_path / "base.json", "base", records(40, 0.1))
    slower = run_file(tmp_path / "slower.json", "slower", records(40, 0.2))
    again = run_file(tmp_path / "again.json", "again", records(40, 0.1))
    assert main(["compare", base, slower, again]) == 0
    lines = capsys.readouterr().out.split("\n\n")[0].splitlines()[1:]  # header and rows
    rows_ = [[(m.group(), m.end()) for m in re.finditer(r"\S+(?: \S+)*", line)] for line in lines]
    header, body = rows_[0], rows_[1:]
    assert [cell for cell, _ in header] == ["figure", "base", "slower", "again"]
    # the second run's value under its label, whatever the width of the cells around it
    assert {row[2][1] for row in body} == {header[2][1]}, lines
    assert any("[n/a" in cell for row in rows_ for cell, _ in row)
    assert any(re.match(r"\[[-+]", cell) for row in rows_ for cell, _ in row)
    for row in body:
        assert len(row) == 8, row  # figure, base, then value, change, interval per later run
        # the right edge of each run's value is its header's; the changes share one edge
        assert [row[i][1] for i in (1, 2, 5)] == [end for _, end in header[1:]], row
        assert (row[3][1], row[6][1]) == (body[0][3][1], body[0][6][1]), row
