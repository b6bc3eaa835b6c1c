"""`tokenprobe bench --endpoint ollama-chat` measures an Ollama directly (here the
simulator in Ollama's shapes): NDJSON streams, counts from the done line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.test_bench import StartSim, bench


@pytest.mark.parametrize(
    ("endpoint", "path"), [("ollama-chat", "/api/chat"), ("ollama-generate", "/api/generate")]
)
def test_bench_measures_ollama_directly(
    start_sim: StartSim, tmp_path: Path, capsys: pytest.CaptureFixture[str], endpoint: str,
    path: str,
) -> None:  # fmt: skip
    sim = start_sim(ttft=0.05, tokens_per_second=500.0, output_tokens=20)
    flags = ("--endpoint", endpoint, "--max-tokens", "8", "--requests", "2")
    rc, doc, _, err = bench(capsys, sim.url, tmp_path / "r.json", *flags)
    assert rc == 0, err
    sent = sim.app.state.requests()
    assert len(sent) == 2 and all(r.path == path for r in sent)
    assert all(r.body["options"]["num_predict"] == 8 for r in sent)  # Ollama's limit
    assert sorted(r["prompt_tokens"] for r in doc["records"]) == sorted(
        r.prompt_tokens for r in sent
    )
    for record in doc["records"]:
        assert record["error_type"] is None and record["token_source"] == "usage"
        assert record["output_tokens"] == 8 and record["finish_reason"] == "length"
        assert record["ttft"] >= 0.05 and record["stream"] is True
