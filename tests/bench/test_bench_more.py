"""`tokenprobe bench` loads the APIs added by issue 18 against the simulator: generate with
token ids, the audio APIs with a generated WAV, Cohere chat, and realtime sessions."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.test_bench import StartSim, bench


@pytest.mark.parametrize(
    ("endpoint", "path", "source", "output"),
    [
        # --max-tokens 8 cuts the sim's 8 text tokens before their EOS ("length", 8); the
        # audio forms carry no limit, so theirs end with the EOS, which vLLM counts (9)
        ("generate", "/inference/v1/generate", "token_ids", 8),
        ("transcriptions", "/v1/audio/transcriptions", "usage", 9),
        ("translations", "/v1/audio/translations", "usage", 9),
        ("cohere", "/cohere/v2/chat", "usage", 8),
    ],
)
def test_each_new_http_api_is_benchmarked(
    start_sim: StartSim, tmp_path: Path, capsys: pytest.CaptureFixture[str], endpoint: str,
    path: str, source: str, output: int,
) -> None:  # fmt: skip
    sim = start_sim(ttft=0.05, tokens_per_second=500.0, output_tokens=8)
    flags = ("--endpoint", endpoint, "--max-tokens", "8", "--requests", "2")
    rc, doc, _, err = bench(capsys, sim.url, tmp_path / "r.json", *flags)
    assert rc == 0, err
    sent = sim.app.state.requests()
    assert len(sent) == 2 and all(r.path == path for r in sent)
    assert sorted(r["prompt_tokens"] for r in doc["records"]) == sorted(
        r.prompt_tokens for r in sent
    )
    for record in doc["records"]:
        assert record["error_type"] is None and record["token_source"] == source
        assert record["output_tokens"] == output and record["ttft"] >= 0.05


def test_realtime_sessions_are_benchmarked(
    start_sim: StartSim, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sim = start_sim(ttft=0.05, tokens_per_second=500.0, output_tokens=8)
    flags = ("--endpoint", "realtime", "--requests", "3", "--concurrency", "2")
    rc, doc, _, err = bench(capsys, sim.url, tmp_path / "r.json", *flags)
    assert rc == 0, err
    assert len(sim.app.realtime_sessions) == 3
    for record in doc["records"]:
        assert record["error_type"] is None and record["token_source"] == "usage"
        assert record["output_tokens"] == 8 and record["ttft"] >= 0.05
        assert record["prompt_tokens"] == 4 + 50  # the simulator's count for 1 s of audio
