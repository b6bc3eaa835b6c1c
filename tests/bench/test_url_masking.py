"""The bench's URLs as it shows them (the run file, stderr): the user info masked whole,
credential parameters' values masked (proxy/core/secrets.py `masked_url`), the URL itself
used as given. `--compare-metrics http://u:PASS@host/metrics` and `?token=` went into the
run file's `config` and `problem` and to stderr as given; a `--url` with a mistyped
scheme was echoed whole; a token given as the user name alone (`http://TOKEN@host`) was
kept; and `bench replay` with user info and --api-key stopped with aiohttp's traceback."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.bench.cli import main
from proxy.bench.replay import main as replay_main
from tests.conftest import MODEL, ProxyUnderTest, Running

StartSim = Callable[..., Running]


def bench(capsys: pytest.CaptureFixture[str], url: str, out: Path, *flags: str) -> tuple[int, dict[str, Any], str]:  # fmt: skip
    """The bench in this process: its exit status, run file, and all it printed."""
    rc = main(["--url", url, "--model", MODEL, "--out", str(out), "--quiet", *flags])
    captured = capsys.readouterr()
    return rc, orjson.loads(out.read_bytes()), captured.out + captured.err


def userinfo(url: str, credentials: str) -> str:
    return url.replace("http://", f"http://{credentials}@")


def test_compare_metrics_credentials_are_used_and_never_shown(
    capsys: pytest.CaptureFixture[str],
    sim: Running,
    start_proxy: Callable[..., ProxyUnderTest],
    tmp_path: Path,
) -> None:
    proxy = start_proxy(sim.url)
    metrics = userinfo(proxy.url, "scraper:CMPLEAK1") + "/metrics?token=CMPLEAK2&x=1"
    flags = ("--requests", "2", "--max-tokens", "2", "--compare-metrics", metrics)
    rc, doc, said = bench(capsys, proxy.url + "/v1", tmp_path / "r.json", *flags)
    assert rc == 0 and doc["compare"]["proxy"]["requests"] == 2, said
    assert doc["config"]["compare_metrics"] == proxy.url.replace("//", "//***@") + "/metrics?token=***&x=1"  # fmt: skip
    assert "CMPLEAK" not in orjson.dumps(doc).decode() + said


@pytest.mark.parametrize(
    ("credentials", "problem"),
    [
        ("scraper:CMPLEAK3", "answered HTTP 404"),
        ("CMPLEAK4TOKEN", "answered HTTP 404"),
        # a password with `@` and `/`: the client takes its end for the host and path
        ("scraper:p@ss/CMPLEAK5", "cannot scrape"),
    ],
)
def test_a_scrape_that_fails_says_so_without_the_urls_credentials(
    capsys: pytest.CaptureFixture[str], sim: Running, tmp_path: Path, credentials: str, problem: str
) -> None:
    metrics = userinfo(sim.url, credentials) + "/nowhere?token=CMPLEAK6"
    flags = ("--requests", "1", "--max-tokens", "2", "--compare-metrics", metrics)
    rc, doc, said = bench(capsys, sim.url + "/v1", tmp_path / "r.json", *flags)
    assert rc == 1 and problem in doc["problem"], said
    assert "//***@127.0.0.1:" in doc["problem"] and "?token=***" in doc["problem"]
    assert "CMPLEAK" not in orjson.dumps(doc).decode() + said


def test_a_scrape_the_client_refuses_is_said_without_its_credentials(
    capsys: pytest.CaptureFixture[str], sim: Running, tmp_path: Path
) -> None:
    """aiohttp's own words quote the URL it refused (a mistyped scheme)."""
    flags = ("--requests", "1", "--compare-metrics", "htp://scraper:CMPLEAK7@h/metrics")
    rc = main(["--url", sim.url + "/v1", "--model", MODEL, "--quiet", *flags])
    said = capsys.readouterr().err
    assert rc == 1 and "cannot scrape htp://***@h/metrics" in said, said
    assert "CMPLEAK" not in said


def test_a_refused_url_is_echoed_without_its_credentials(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc = main(["--url", "htp://user:URLLEAK1@vllm:8000/v1?key=URLLEAK2", "--model", MODEL])
    said = capsys.readouterr().err
    assert rc == 2 and "got 'htp://***@vllm:8000/v1?key=***'" in said, said
    assert "URLLEAK" not in said


def test_a_token_given_as_the_user_name_is_masked_in_the_run_file(
    capsys: pytest.CaptureFixture[str], sim: Running, tmp_path: Path
) -> None:
    url = userinfo(sim.url, "URLTOKENLEAK3") + "/v1"
    rc, doc, said = bench(capsys, url, tmp_path / "r.json", "--requests", "1", "--max-tokens", "2")
    assert rc == 0, said
    assert doc["config"]["base_url"] == sim.url.replace("//", "//***@")
    assert "URLTOKENLEAK" not in orjson.dumps(doc).decode() + said


def test_replay_with_user_info_and_an_api_key_runs_and_shows_neither(
    capsys: pytest.CaptureFixture[str], sim: Running, tmp_path: Path
) -> None:
    """aiohttp refuses user info beside an Authorization header: the replay sized its
    prompts with /tokenize that way and stopped with a traceback. It now sends no user
    info, as the load's own requests do."""
    trace = tmp_path / "trace.jsonl"
    lines = [{"timestamp": t, "input_length": 20, "output_length": 2, "hash_ids": [t]} for t in (0, 20)]  # fmt: skip
    trace.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    out = tmp_path / "r.json"
    url = userinfo(sim.url, "user:REPLAYLEAK1") + "/v1"
    flags = ["--mooncake", str(trace), "--model", MODEL, "--url", url, "--out", str(out)]
    rc = replay_main([*flags, "--api-key", "REPLAYKEYLEAK2", "--quiet"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    doc = orjson.loads(out.read_bytes())
    assert [r["error_type"] for r in doc["records"]] == [None, None], doc["records"]
    assert "LEAK" not in orjson.dumps(doc).decode() + captured.out + captured.err
