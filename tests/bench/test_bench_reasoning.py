"""`tokenprobe bench` on a reasoning model and an agent (issue 26), against the simulator:
the report gives the first answer beside the first token, the reasoning tokens and the
tool calls by outcome, and `bench compare` compares them."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from proxy.bench.compare_runs import compare_runs, render
from proxy.bench.runs import load
from proxy.sim.app import create_sim_app
from proxy.sim.config import SimConfig
from tests.conftest import MODEL
from tests.servers import ThreadedServer
from tests.tokenizers_local import build_tiny_tokenizer

REQUESTS = 8
FLAGS = ("--concurrency", "2", "--requests", str(REQUESTS), "--max-tokens", "64")


def _bench(url: str, out: Path, *flags: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "proxy.bench", "--url", url, "--model", MODEL, "--out", str(out),
         *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def sim_url() -> Iterator[str]:
    app = create_sim_app(SimConfig(models=(MODEL,), ttft=0.02, tokens_per_second=400))
    server = ThreadedServer(app).start()
    yield server.url + "/v1"
    server.stop()


def test_bench_reports_first_answer_reasoning_tokens_and_tool_calls(
    sim_url: str, tmp_path: Path
) -> None:
    program = ("--header", "x-sim-reasoning-tokens: 20", "--header", "x-sim-output-tokens: 4",
               "--header", "x-sim-tool-calls: 1", "--header", "x-sim-invalid-tool-calls: 1")  # fmt: skip
    printed = _bench(sim_url, tmp_path / "run.json", *FLAGS, *program)
    (summary,) = orjson.loads((tmp_path / "run.json").read_bytes())["summary"]
    assert summary["reasoned"] == REQUESTS and summary["reasoning_tokens"] == 20 * REQUESTS
    assert summary["tool_calls"] == {"invalid_arguments": REQUESTS}
    assert summary["ttfa"]["p50"] > summary["ttft"]["p50"]  # 20 reasoning tokens later
    assert f"{REQUESTS} requests reasoned (160 reasoning tokens)" in printed
    assert f"tool calls: invalid_arguments {REQUESTS}" in printed


def test_bench_compare_compares_first_answer_and_reasoning(sim_url: str, tmp_path: Path) -> None:
    paths = []
    for name, thinking in (("short", "10"), ("long", "40")):
        paths.append(tmp_path / f"{name}.json")
        _bench(sim_url, paths[-1], *FLAGS, "--quiet", "--label", name,
               "--header", f"x-sim-reasoning-tokens: {thinking}",
               "--header", "x-sim-output-tokens: 4")  # fmt: skip
    (level,) = compare_runs([load(str(p)) for p in paths])
    assert level.values["short"]["reasoning_tokens_mean"] == 10
    assert level.values["long"]["reasoning_tokens_mean"] == 40
    change = level.changes["long"]["ttfa_p50"]
    assert change.value is not None and change.base is not None and change.value > change.base
    assert level.values["long"]["without_answer_share"] == 0
    text = render([level], 95, 0.05, 2000, 0)
    assert "first answer p50 (ms)" in text and "reasoning tokens, mean (tok)" in text


def test_a_tokenizer_counts_the_reasoning_too_and_never_overrides_the_engines_count(
    sim_url: str, tmp_path: Path
) -> None:
    """With --tokenizer and no usage, the reasoning is counted by the tokenizer, as the
    proxy counts it (the bench's recount once dropped it: "2 requests reasoned, 0
    reasoning tokens"); and a count the engine gave (llama.cpp's timings) stays the
    engine's, ahead of the tokenizer in the proxy's order (TokenSource)."""
    tokenizer = str(build_tiny_tokenizer(tmp_path / "tok"))
    no_usage = ("--header", "x-sim-usage-mode: ignore", "--no-ignore-eos", "--tokenizer", tokenizer)
    reasoning = ("--header", "x-sim-reasoning-tokens: 5", "--header", "x-sim-output-tokens: 10")
    _bench(sim_url, tmp_path / "r.json", *FLAGS, *no_usage, *reasoning, "--quiet")
    doc = orjson.loads((tmp_path / "r.json").read_bytes())
    assert doc["summary"][0]["reasoned"] == REQUESTS
    for record in doc["records"]:
        assert record["token_source"] == "tokenizer"
        assert record["reasoning_token_source"] == "tokenizer" and record["reasoning_tokens"] > 0
        assert record["answer_tpot"] is not None
    llamacpp = ("--header", "x-sim-backend-kind: llamacpp", "--header", "x-sim-output-tokens: 10")
    _bench(sim_url, tmp_path / "e.json", *FLAGS, *no_usage, *llamacpp, "--quiet")
    records = orjson.loads((tmp_path / "e.json").read_bytes())["records"]
    # llama.cpp's predicted_n: the 10 text tokens and the EOS
    assert {(r["token_source"], r["output_tokens"]) for r in records} == {("engine", 11)}
