"""Record a known workload through a real `tokenprobe serve`, replay its log on another
simulator, and check that the replay kept the shape and dropped the content.

The ground truth of the recording is the recording simulator's own request records
(body and response id); the log's `response_id` ties each log line to one of them, and
each replayed record's `response_id` ties it to what the replay target received.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from proxy.bench.trace import read_logs
from tests.conftest import MODEL, Running
from tests.servers import free_port, spawn, stop, wait_http

StartSim = Callable[..., Running]
N = 36
SYSTEMS = {
    "A": "You are the billing assistant of ACME-ALPHA. " * 26,  # ~1200 characters each
    "B": "You answer questions about the ZETA-BRAVO rail network. " * 21,
}
USER_SIZES = (30, 400, 1500)  # characters: three prompt sizes
APIS = ("chat", "completions", "messages")


def workload() -> list[dict[str, Any]]:
    rng = random.Random(7)
    at, out = 0.0, []
    for i in range(N):
        at += rng.expovariate(15.0) if i else 0.0
        user = f"QUESTION-{i:03d} " + "lorem ipsum dolor " * (USER_SIZES[i % 3] // 18)
        out.append(
            {
                "at": at,
                "api": APIS[i % 3],
                "stream": (i // 3) % 2 == 0,
                "system": ("A", "B", None)[(i // 6) % 3],
                "user": user,
                "max_tokens": (8, 16, 24)[(i // 2) % 3],
            }
        )
    return out


def body(item: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    system = SYSTEMS[item["system"]] if item["system"] else None
    common = {"model": MODEL, "max_tokens": item["max_tokens"], "stream": item["stream"]}
    if item["api"] == "completions":
        return "/v1/completions", {**common, "prompt": (system or "") + item["user"]}
    messages = [{"role": "user", "content": item["user"]}]
    if item["api"] == "messages":
        return "/v1/messages", {**common, **({"system": system} if system else {}), "messages": messages}  # fmt: skip
    if system:
        messages.insert(0, {"role": "system", "content": system})
    return "/v1/chat/completions", {**common, "messages": messages}


async def send_all(base: str, items: list[dict[str, Any]]) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        start = time.monotonic()

        async def one(item: dict[str, Any]) -> None:
            await asyncio.sleep(max(0.0, start + item["at"] - time.monotonic()))
            path, payload = body(item)
            r = await client.post(path, json=payload)
            assert r.status_code == 200, r.text

        await asyncio.gather(*(one(item) for item in items))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The workload sent through `tokenprobe serve` to a simulator; its access log."""
    from proxy.sim.app import create_sim_app
    from proxy.sim.config import SimConfig
    from tests.servers import ThreadedServer

    tmp = tmp_path_factory.mktemp("recorded")
    app = create_sim_app(SimConfig(models=(MODEL,), ttft=0.02, tokens_per_second=400))
    sim = ThreadedServer(app).start()
    port = free_port()
    log = tmp / "access.log"
    with open(log, "wb") as f:
        f.write(b"some other program's output, not a record\n")
        f.flush()
        proxy = spawn("serve", "--upstream", sim.url, "--port", str(port), "--log-salt", "t", stdout=f.fileno())  # fmt: skip
        try:
            wait_http(f"http://127.0.0.1:{port}/healthz")
            items = workload()
            asyncio.run(send_all(f"http://127.0.0.1:{port}", items))
            deadline = time.monotonic() + 20
            while log.read_bytes().count(b'"endpoint"') < N and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            stop(proxy)
    with open(log, "ab") as f:
        f.write(b'{"ts": "2026-01-01T00:00:00.000Z", "endpoint": "/v1/chat/comp')  # truncated
    truth = {r.id: r.body for r in app.state.requests() if r.path.startswith("/v1/")}
    sim.stop()
    yield {"log": log, "items": items, "truth": truth, "tmp": tmp}


def replay(log: Path, url: str, out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy.bench", "replay", str(log), "--url", url, "--out", str(out),
         "--quiet", *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def group_of(body: dict[str, Any]) -> str | None:
    """Which system prompt a recorded body began with."""
    text = orjson.dumps(body).decode()
    return next((name for name, s in SYSTEMS.items() if s[:60] in text), None)


def lead(path: str, body: dict[str, Any]) -> str:
    """The leading text a prefix cache would see first, as the replay sent it."""
    if path == "/v1/completions":
        return str(body["prompt"])
    if path == "/v1/messages":
        return str(body.get("system") or "") + "|" + str(body["messages"][0]["content"])
    first = body["messages"][0]
    return (first["content"] if first["role"] == "system" else "") + "|" + body["messages"][-1]["content"]  # fmt: skip


def common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.quiet("a timing read within tens of milliseconds", seconds=4.5)
def test_replay_keeps_the_recorded_shape_and_sends_no_recorded_content(
    recorded: dict[str, Any], start_sim: StartSim, tmp_path: Path
) -> None:
    log = recorded["log"]
    wants, skipped = read_logs([str(log)])
    assert len(wants) == N and skipped.count == 2  # the foreign line and the truncated one
    lines = sorted(
        (orjson.loads(x) for x in log.read_bytes().splitlines() if x.startswith(b'{"ts"') and x.endswith(b"}")),
        key=lambda r: r["arrival"],
    )  # fmt: skip
    assert len(lines) == N
    recorded_group = [group_of(recorded["truth"][line["response_id"]]) for line in lines]

    target = start_sim(ttft=0.05, tokens_per_second=200)
    proc = replay(log, target.url + "/v1", tmp_path / "r.json")
    assert proc.returncode == 0, proc.stderr
    assert "skipped 2 lines" in proc.stderr and ":1" in proc.stderr
    assert "recorded vs replayed" in proc.stdout and "TTFT ms p50" in proc.stdout
    doc = orjson.loads((tmp_path / "r.json").read_bytes())
    records = doc["records"]
    # Every request replayed once, at its recorded offset.
    assert sorted(r["index"] for r in records) == list(range(N))
    received = {r.id: r for r in target.app.state.requests() if r.path.startswith("/v1/")}
    assert len(received) == N
    by_index = {r["index"]: received[r["response_id"]] for r in records}
    # Received at the recorded offsets, counted from the run's start (the median shift).
    origin = statistics.median(by_index[i].started - w.offset for i, w in enumerate(wants))
    for i, want in enumerate(wants):
        got = by_index[i]
        assert abs(got.started - origin - want.offset) < 0.06, (
            i,
            got.started - origin,
            want.offset,
        )
        # Same API and stream flag; prompt within 3% or 3 tokens; the recorded output.
        assert got.path == want.endpoint and got.stream == want.stream
        assert abs(got.prompt_tokens - want.prompt_tokens) <= max(3, 0.03 * want.prompt_tokens)
        assert got.completion_tokens == want.output_tokens == lines[i]["output_tokens"]
    # The two shared system prompts are shared again, and nothing else is.
    leads = {i: lead(by_index[i].path, by_index[i].body) for i in range(N)}
    family = {i: "text" if wants[i].endpoint == "/v1/completions" else "messages" for i in range(N)}
    for i in range(N):
        for j in range(i + 1, N):
            shared = common_prefix(leads[i], leads[j])
            same = recorded_group[i] is not None and recorded_group[i] == recorded_group[j]
            if same and family[i] == family[j]:
                assert shared >= 200, (i, j, shared)
            else:
                assert shared < 40, (i, j, recorded_group[i], recorded_group[j], shared)
    # No recorded content reached the target.
    seen = orjson.dumps([r.body for r in received.values()]).decode()
    assert "QUESTION-" not in seen and "lorem" not in seen
    assert "ACME" not in seen and "ZETA" not in seen


@pytest.mark.quiet("a timing read within tens of milliseconds", seconds=1.2)
def test_speed_two_halves_the_span(recorded: dict[str, Any], start_sim: StartSim, tmp_path: Path) -> None:  # fmt: skip
    wants, _ = read_logs([str(recorded["log"])])
    span = wants[-1].offset
    target = start_sim(ttft=0.02, tokens_per_second=500)
    proc = replay(recorded["log"], target.url + "/v1", tmp_path / "fast.json", "--speed", "2")
    assert proc.returncode == 0, proc.stderr
    doc = orjson.loads((tmp_path / "fast.json").read_bytes())
    assert max(r["scheduled"] for r in doc["records"]) == pytest.approx(span / 2, abs=1e-6)
    starts = [r.started for r in target.app.state.requests() if r.path.startswith("/v1/")]
    assert abs((max(starts) - min(starts)) - span / 2) < 0.06


def test_mooncake_export_round_trips_and_shares_ids_where_prefixes_were_shared(
    recorded: dict[str, Any], tmp_path: Path
) -> None:
    log = recorded["log"]
    wants, _ = read_logs([str(log)])
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    run = [sys.executable, "-m", "proxy.bench", "replay"]
    first = subprocess.run([*run, str(log), "--export-mooncake", str(one), "--block-size", "64"], capture_output=True, text=True)  # fmt: skip
    assert first.returncode == 0, first.stderr
    again = subprocess.run([*run, "--mooncake", str(one), "--model", MODEL, "--block-size", "64", "--export-mooncake", str(two)], capture_output=True, text=True)  # fmt: skip
    assert again.returncode == 0, again.stderr
    entries = [orjson.loads(x) for x in one.read_bytes().splitlines()]
    assert one.read_bytes() == two.read_bytes()
    assert [e["timestamp"] for e in entries] == [round(w.offset * 1000) for w in wants]
    assert [(e["input_length"], e["output_length"]) for e in entries] == [(w.prompt_tokens, w.output_tokens) for w in wants]  # fmt: skip
    firsts = [e["hash_ids"][0] for e in entries]
    shared = {i for i in firsts if firsts.count(i) > 1}
    assert 2 <= len(shared) <= 4  # A and B, once for message APIs and once for text prompts


def test_nothing_to_replay_exits_2_with_a_clear_message(tmp_path: Path) -> None:
    log = tmp_path / "empty.log"
    log.write_text("INFO: started\nnot json either\n")
    proc = replay(log, "http://127.0.0.1:9/v1", tmp_path / "r.json")
    assert proc.returncode == 2
    assert "nothing to replay" in proc.stderr and "empty.log:1" in proc.stderr


@pytest.mark.quiet("a timing read within tens of milliseconds", seconds=2.5)
def test_two_workers_replay_every_request_on_one_clock_into_one_run(
    recorded: dict[str, Any], start_sim: StartSim, tmp_path: Path
) -> None:
    wants, _ = read_logs([str(recorded["log"])])
    target = start_sim(ttft=0.02, tokens_per_second=500)
    proc = replay(recorded["log"], target.url + "/v1", tmp_path / "w.json", "--workers", "2")
    assert proc.returncode == 0, proc.stderr
    assert "recorded vs replayed" in proc.stdout
    doc = orjson.loads((tmp_path / "w.json").read_bytes())
    records = doc["records"]
    assert [r["index"] for r in records] == list(range(N))  # merged in schedule order
    assert [r["scheduled"] for r in records] == pytest.approx([w.offset for w in wants], abs=1e-9)
    assert doc["summary"][0]["requests"] == N and doc["config"]["shards"] == 2
    received = {r.id: r.started for r in target.app.state.requests() if r.path.startswith("/v1/")}
    pairs = [(received[r["response_id"]], w.offset) for r, w in zip(records, wants, strict=True)]
    origin = statistics.median(at - offset for at, offset in pairs)
    assert all(abs(at - origin - offset) < 0.06 for at, offset in pairs)


def test_an_interrupted_replay_on_workers_writes_what_they_measured_and_exits_130(
    recorded: dict[str, Any], start_sim: StartSim, tmp_path: Path
) -> None:
    """As one process does (docs/benchmarking.md): the merged run said `interrupted` and
    the parent exited 0."""
    import os
    import signal

    target = start_sim(ttft=0.01, tokens_per_second=1000)
    out = tmp_path / "i.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.bench", "replay", str(recorded["log"]), "--url",
         target.url + "/v1", "--out", str(out), "--quiet", "--workers", "2", "--speed", "0.05"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, process_group=0,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not any(r.path.startswith("/v1/") for r in target.app.state.requests()):
            assert time.monotonic() < deadline, "no request replayed"
            time.sleep(0.05)
        time.sleep(0.3)  # the first request answered (10 ms to its first token)
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stderr
    assert orjson.loads(out.read_bytes())["status"] == "interrupted"


def test_shards_run_apart_merge_into_one_run_and_other_runs_are_refused(
    recorded: dict[str, Any], start_sim: StartSim, tmp_path: Path
) -> None:
    from proxy.bench.cli import main

    target = start_sim(ttft=0.01, tokens_per_second=1000)
    url = target.url + "/v1"
    for i in (0, 1):
        proc = replay(recorded["log"], url, tmp_path / f"s{i}.json", "--shard", f"{i}/2")
        assert proc.returncode == 0, proc.stderr
    assert main(["merge", str(tmp_path / "s0.json"), str(tmp_path / "s1.json"), "--out", str(tmp_path / "m.json")]) == 0  # fmt: skip
    merged = orjson.loads((tmp_path / "m.json").read_bytes())
    assert sorted(r["index"] for r in merged["records"]) == list(range(N))
    assert merged["summary"][0]["requests"] == N
    shards = [orjson.loads((tmp_path / f"s{i}.json").read_bytes()) for i in (0, 1)]
    assert merged["summary"][0]["duration"] == max(s["summary"][0]["duration"] for s in shards)
    other = replay(recorded["log"], url, tmp_path / "fast.json", "--shard", "1/2", "--speed", "2")
    assert other.returncode == 0, other.stderr
    assert main(["merge", str(tmp_path / "s0.json"), str(tmp_path / "fast.json"), "--out", str(tmp_path / "x.json")]) == 2  # fmt: skip


def test_a_target_that_refuses_is_reported_by_error_type(recorded: dict[str, Any], start_sim: StartSim, tmp_path: Path) -> None:  # fmt: skip
    target = start_sim(ttft=0.01, api_key="secret")
    proc = replay(recorded["log"], target.url + "/v1", tmp_path / "r.json", "--api-key", "wrong", "--tokenizer", str(tokenizer(tmp_path)))  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "error: auth:" in proc.stderr and "wrong" not in proc.stderr
    doc = orjson.loads((tmp_path / "r.json").read_bytes())
    assert doc["status"] == "failing" and {r["error_type"] for r in doc["records"]} == {"auth"}


def tokenizer(tmp_path: Path) -> Path:
    from tests.tokenizers_local import build_tiny_tokenizer

    return build_tiny_tokenizer(tmp_path / "tok")


def test_prompts_sized_with_a_local_tokenizer_replay_like_the_log(recorded: dict[str, Any], start_sim: StartSim, tmp_path: Path) -> None:  # fmt: skip
    target = start_sim(ttft=0.01, tokens_per_second=1000)
    proc = replay(recorded["log"], target.url + "/v1", tmp_path / "r.json", "--tokenizer", str(tokenizer(tmp_path)), "--max-requests", "6")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = orjson.loads((tmp_path / "r.json").read_bytes())
    assert len(doc["records"]) == 6 and all(r["error_type"] is None for r in doc["records"])
    assert "missed their recorded length" not in proc.stderr


def test_a_mooncake_trace_replays_with_its_lengths_and_shared_blocks(recorded: dict[str, Any], start_sim: StartSim, tmp_path: Path) -> None:  # fmt: skip
    trace = tmp_path / "t.jsonl"
    run = [sys.executable, "-m", "proxy.bench", "replay"]
    assert subprocess.run([*run, str(recorded["log"]), "--export-mooncake", str(trace), "--block-size", "64"], capture_output=True).returncode == 0  # fmt: skip
    entries = [orjson.loads(x) for x in trace.read_bytes().splitlines()]
    target = start_sim(ttft=0.01, tokens_per_second=1000)
    proc = subprocess.run(
        [*run, "--mooncake", str(trace), "--model", MODEL, "--block-size", "64", "--url", target.url + "/v1",
         "--endpoint", "completions", "--out", str(tmp_path / "m.json"), "--quiet"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = orjson.loads((tmp_path / "m.json").read_bytes())
    got = {r.id: r for r in target.app.state.requests() if r.path == "/v1/completions"}
    assert len(doc["records"]) == len(entries) == len(got)
    prompts = {}
    for r in doc["records"]:
        entry, sent = entries[r["index"]], got[r["response_id"]]
        assert abs(sent.prompt_tokens - entry["input_length"]) <= max(
            3, 0.03 * entry["input_length"]
        )
        assert sent.completion_tokens == entry["output_length"]
        prompts[r["index"]] = sent.body["prompt"]
    for i, a in enumerate(entries):
        for j in range(i + 1, len(entries)):
            shared = common_prefix(prompts[i], prompts[j])
            if a["hash_ids"][0] == entries[j]["hash_ids"][0]:
                assert shared >= 100, (i, j, shared)  # one 64-token block at least
            else:
                assert shared < 40, (i, j, shared)


def test_a_tokenize_refusal_names_no_credential(recorded: dict[str, Any], tmp_path: Path) -> None:
    """Without --tokenizer the prompts are sized with the target's /tokenize; a target that
    refuses the key and repeats it: the one line the replay stops with names neither."""
    from tests.servers import echoing, serve

    def said(scope: dict[str, Any], sent: dict[bytes, bytes]) -> bytes:
        keys = sent.get(b"authorization", b"") + b" " + sent.get(b"x-api-key", b"")
        return b'{"error": {"message": "Incorrect API key provided: ' + keys + b'"}}'

    with serve(echoing(said, status=401), lifespan="off") as target:
        proc = replay(recorded["log"], target.url + "/v1", tmp_path / "r.json",
                      "--api-key", "REPLAYKEYLEAK0123", "--header", "x-api-key: REPLAYXLEAK45")  # fmt: skip
    assert proc.returncode == 1 and "answered HTTP 401" in proc.stderr, proc.stderr
    assert "Incorrect API key provided" in proc.stderr
    assert "REPLAYKEYLEAK" not in proc.stderr and "REPLAYXLEAK" not in proc.stderr, proc.stderr


def mooncake(tmp_path: Path) -> str:
    trace = tmp_path / "trace.jsonl"
    lines = [{"timestamp": t, "input_length": 20, "output_length": 4, "hash_ids": [t]} for t in (0, 50)]  # fmt: skip
    trace.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    return str(trace)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_an_unreachable_target_exits_1_as_bench_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], workers: str
) -> None:
    """Exit codes mean one thing in both: 1 a backend that did not answer (replay sizes its
    prompts with the target's /tokenize first, and exited 2 there, bench's bad flags), 2 a
    bad flag."""
    from proxy.bench import cli
    from proxy.bench import replay as replay_cli

    url = "http://127.0.0.1:9/v1"  # the discard port: connection refused
    flags = ["--mooncake", mooncake(tmp_path), "--model", MODEL, "--url", url, "--quiet"]
    assert replay_cli.main([*flags, "--workers", workers]) == 1
    assert "cannot reach http://127.0.0.1:9/tokenize" in capsys.readouterr().err
    assert cli.main(["--url", url, "--model", MODEL, "--quiet", "--requests", "3"]) == 1


def test_a_tokenizer_counts_what_a_target_without_usage_does_not_send(
    start_sim: StartSim, tmp_path: Path
) -> None:
    """--tokenizer sizes the prompts and, as bench's, counts the tokens of a target that
    sends no usage: the replay used to count its output by chunks and no prompt at all."""
    from proxy.bench import replay as replay_cli

    target = start_sim(ttft=0.01, tokens_per_second=1000)
    out = tmp_path / "r.json"
    assert replay_cli.main([
        "--mooncake", mooncake(tmp_path), "--model", MODEL, "--endpoint", "completions",
        "--url", target.url + "/v1", "--tokenizer", str(tokenizer(tmp_path)),
        "--header", "x-sim-usage-mode: ignore", "--out", str(out), "--quiet",
    ]) == 0  # fmt: skip
    records = orjson.loads(out.read_bytes())["records"]
    assert [r["token_source"] for r in records] == ["tokenizer", "tokenizer"]
    assert all(abs(r["prompt_tokens"] - 20) <= 3 for r in records), records
