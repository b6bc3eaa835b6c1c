"""Bad flags, trace lines and run files: a one-line error naming the flag or the file
(exit 2), or a skipped and counted line, never a traceback, a hang or a run without end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.bench import cli, replay
from proxy.bench.trace import read_logs, read_mooncake

URL = "http://127.0.0.1:9/v1"  # the discard port: nothing here may get as far as sending
CHAT = "/v1/chat/completions"
ZERO_DURATION = {"label": "c=1", "value": 1, "duration": 0}  # every throughput divides by it


def one_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "error:" in err, err
    return err


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--rate", "2", "--duration", "nan"], "--duration"),
        (["--rate", "2", "--duration", "inf"], "--duration"),
        (["--rate", "nan"], "--rate"),
        (["--rate", "inf"], "--rate"),
        (["--timeout", "nan"], "--timeout"),
        (["--timeout", "inf"], "--timeout"),
        (["--ramp-up", "nan"], "--ramp-up"),
    ],
)
def test_bench_refuses_a_non_finite_number_naming_its_flag(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["--url", URL, "--model", "m", "--quiet", *flags]) == 2
    assert named in one_error(capsys)


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--concurrency", "1,1"], "--concurrency: 1 is given twice"),
        (["--concurrency", "4,2,04"], "--concurrency: 4 is given twice"),
        (["--rate", "5,5.0"], "--rate: 5 is given twice"),
        (["--rate", "1.0000001,1.0000002"], "are both rate=1/s"),
        (["--input-tokens", "8,8", "--tokenizer", "/x"], "--input-tokens: 8 is given twice"),
    ],
)
def test_bench_refuses_a_level_given_twice(
    flags: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Levels are named by their labels (c=1, rate=5/s) in the table, the JSON and `bench
    compare`: two runs of one level were pooled there into one row."""
    assert cli.main(["--url", URL, "--model", "m", "--quiet", *flags]) == 2
    assert said in one_error(capsys)


def test_bench_refuses_ramp_up_with_a_rate(capsys: pytest.CaptureFixture[str]) -> None:
    """--ramp-up spreads the closed loop's streams; with --rate it did nothing, silently."""
    assert cli.main(["--url", URL, "--model", "m", "--quiet", "--rate", "5", "--ramp-up", "3"]) == 2
    assert "--ramp-up applies to --concurrency (closed loop) only" in one_error(capsys)


@pytest.fixture
def log(tmp_path: Path) -> Path:
    path = tmp_path / "access.log"
    line = {"arrival": 1.0, "endpoint": CHAT, "model": "m", "stream": True,
            "prompt_tokens": 20, "output_tokens": 5}  # fmt: skip
    path.write_bytes(orjson.dumps(line) + b"\n")
    return path


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--url", "ftp://x"], "--url"),
        (["--url", URL, "--slo", "foo=1"], "--slo"),
        (["--url", URL, "--header", "nocolon"], "--header"),
        (["--url", URL, "--timeout", "0"], "--timeout"),
        (["--url", URL, "--timeout", "nan"], "--timeout"),
        (["--url", URL, "--speed", "inf"], "--speed"),
        (["--url", URL, "--tokenizer", "/nonexistent"], "--tokenizer"),  # was a traceback
    ],
)
def test_replay_refuses_a_bad_flag_in_one_line_naming_it(
    log: Path, flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert replay.main([str(log), "--quiet", *flags]) == 2
    assert named in one_error(capsys)


def good(**changes: Any) -> dict[str, Any]:
    return {"arrival": 1.0, "endpoint": CHAT, "model": "m", "stream": True,
            "prompt_tokens": 20, "output_tokens": 5, **changes}  # fmt: skip


def test_access_log_lines_with_fields_of_the_wrong_type_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "access.log"
    bad = [good(endpoint=["x"]), good(prompt_chars="abc"), good(prompt_chars=[1])]
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in [good(), *bad]))
    wants, skipped = read_logs([str(path)])
    assert len(wants) == 1 and skipped.count == 3, skipped
    assert skipped.where == [f"{path}:2", f"{path}:3", f"{path}:4"]


def test_mooncake_lines_that_are_no_entries_are_skipped_never_waited_for(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    lines = [
        b'{"timestamp": 0, "input_length": 20, "output_length": 5}',
        b'{"timestamp": "inf", "input_length": 20, "output_length": 5}',  # forever away
        b'{"timestamp": "nan", "input_length": 20, "output_length": 5}',
        b'{"timestamp": 1, "input_length": 20, "output_length": 1e30}',  # no int64
        b'{"timestamp": 2, "input_length": 2000, "output_length": 5, "hash_ids": "12"}',
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    wants, skipped = read_mooncake(str(path), CHAT, "m", True)
    assert [w.offset for w in wants] == [0.0] and skipped.count == 4, skipped


def test_a_mooncake_export_of_a_trace_with_bad_lines_writes_the_good_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace, out = tmp_path / "trace.jsonl", tmp_path / "out.mc"
    trace.write_bytes(
        b'{"timestamp": 0, "input_length": 20, "output_length": 1e30}\n'
        b'{"timestamp": 5, "input_length": 20, "output_length": 5}\n'
    )
    flags = ["--mooncake", str(trace), "--model", "m", "--export-mooncake", str(out)]
    assert replay.main(flags) == 0
    assert [orjson.loads(x)["output_length"] for x in out.read_bytes().splitlines()] == [5]
    assert "skipped 1 lines" in capsys.readouterr().err


@pytest.mark.parametrize(
    "doc",
    [
        {"tool": "tokenprobe bench", "records": [{}], "summary": []},
        {"tool": "tokenprobe bench", "records": None},
        {"tool": "tokenprobe bench", "records": [], "summary": [{"label": "c=1"}]},
        {"tool": "tokenprobe bench", "records": [], "summary": [ZERO_DURATION]},
    ],
)
def test_compare_names_a_malformed_run_file_and_exits_2(
    doc: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good_run, bad_run = tmp_path / "good.json", tmp_path / "bad.json"
    good_run.write_bytes(orjson.dumps({"tool": "tokenprobe bench", "records": [], "summary": []}))
    bad_run.write_bytes(orjson.dumps(doc))
    assert cli.main(["compare", str(good_run), str(bad_run)]) == 2
    assert str(bad_run) in one_error(capsys)
