"""`tokenprobe bench replay` keeps conversations as conversations: each later turn goes its
recorded gap after the candidate answered the turn before, never before that answer, and
one conversation's turns stay on one shard."""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from proxy.bench.replay import continues, conversation_shards, follows
from proxy.bench.trace import Want, read_logs
from proxy.sim.app import create_sim_app
from proxy.sim.config import SimConfig
from tests.conftest import MODEL
from tests.servers import ThreadedServer, free_port, spawn, stop, wait_http

GAPS = {"a": (0.2, 0.3), "b": (0.1, 0.25)}  # each agent's tool time between its 3 turns
SLACK = 0.5  # a loaded 2-core machine's delay on top of a sleep


def want(conversation: str | None, turn: int | None, gap: float | None, offset: float) -> Want:
    return Want(
        offset, "/v1/chat/completions", MODEL, True, 100, 8, (), {}, conversation, turn, gap
    )


def test_a_later_turn_follows_the_previous_turn_of_its_conversation() -> None:
    wants = [
        want("a", 1, None, 0.0),
        want("b", 1, None, 0.1),
        want(None, None, None, 0.2),  # a log without conversations: at its offset
        want("a", 2, 0.5, 0.7),
        want("b", 2, 0.2, 0.8),
        want("a", 3, 0.4, 1.5),
        want("c", 4, 0.3, 2.0),  # its earlier turns are not replayed (--window): at its offset
    ]
    assert continues(wants) == [None, None, None, 0, 1, 3, None]
    assert follows(wants, speed=1.0) == [None, None, None, (0, 0.5), (1, 0.2), (3, 0.4), None]
    assert follows(wants, speed=2.0)[3] == (0, 0.25)
    assert conversation_shards(wants) == [0, 1, 2, 0, 1, 0, 6]


def test_the_log_s_conversation_fields_are_read_and_bad_ones_dropped(tmp_path: Path) -> None:
    base = {"endpoint": "/v1/chat/completions", "prompt_tokens": 10, "output_tokens": 2}
    lines = [
        {**base, "arrival": 1.0, "conversation": "c1", "turn": 1, "turn_gap_ms": None},
        {**base, "arrival": 2.0, "conversation": "c1", "turn": 2, "turn_gap_ms": 250.0},
        {**base, "arrival": 3.0, "conversation": 5, "turn": "x", "turn_gap_ms": -1},
    ]
    log = tmp_path / "access.log"
    log.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    wants, _ = read_logs([str(log)])
    got = [(w.conversation, w.turn, w.turn_gap) for w in wants]
    assert got == [("c1", 1, None), ("c1", 2, 0.25), (None, None, None)]


def agent(client: httpx.Client, name: str) -> None:
    messages: list[Any] = [{"role": "user", "content": f"agent {name}: " + "plan the trip " * 20}]
    for turn in range(3):
        body = {"model": MODEL, "messages": messages, "max_tokens": 8, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            response.read()
        if turn < 2:
            messages.append({"role": "assistant", "content": "calling the tool"})
            time.sleep(GAPS[name][turn])
            messages.append({"role": "tool", "tool_call_id": "c", "content": "result " * 10})


@pytest.mark.quiet(
    "the turn gaps are programmed sleeps read within a slack, in the recording and the replay",
    seconds=5,
)
def test_a_replay_on_a_slower_candidate_keeps_each_turn_after_its_answer(tmp_path: Path) -> None:
    fast = ThreadedServer(
        create_sim_app(SimConfig(models=(MODEL,), ttft=0.01, tokens_per_second=2000))
    ).start()
    port = free_port()
    log = tmp_path / "access.log"
    with log.open("wb") as f:
        proxy = spawn("serve", "--upstream", fast.url, "--port", str(port), "--log-salt", "t", stdout=f.fileno())  # fmt: skip
        try:
            wait_http(f"http://127.0.0.1:{port}/healthz")
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                agent(client, "a")
                agent(client, "b")
            deadline = time.monotonic() + 20
            while log.read_bytes().count(b'"endpoint"') < 6 and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            stop(proxy)
            fast.stop()
    # The candidate takes 0.6 s to its first token: at the recorded offsets every turn
    # would go before the answer it continues had ended.
    app = create_sim_app(SimConfig(models=(MODEL,), ttft=0.6, tokens_per_second=2000))
    slow = ThreadedServer(app).start()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "proxy.bench", "replay", str(log), "--url", slow.url,
             "--out", str(tmp_path / "run.json"), "--quiet"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        sent = sorted(
            (r for r in app.state.requests() if r.path == "/v1/chat/completions"),
            key=lambda r: r.started,
        )
    finally:
        slow.stop()
    assert len(sent) == 6
    # Each later turn repeats all of its earlier turn's messages (synthetic ones): two
    # conversations of three turns, as recorded.
    conversations: list[list[Any]] = []
    for r in sent:
        messages = r.body["messages"]
        turns = next((c for c in conversations if messages[: len(c[-1].body["messages"])] == c[-1].body["messages"]), None)  # fmt: skip
        if turns is None:
            conversations.append([r])
        else:
            turns.append(r)
    assert sorted(len(turns) for turns in conversations) == [3, 3]
    gaps = sorted(
        round(later.started - earlier.finished_at, 3)
        for turns in conversations
        for earlier, later in itertools.pairwise(turns)
    )
    expected = sorted(g for pair in GAPS.values() for g in pair)
    for gap, sleep in zip(gaps, expected, strict=True):
        assert sleep - 0.05 <= gap <= sleep + SLACK, (gaps, expected)


def entry(arrival: float, prompt: int, output: int, **conversation: Any) -> dict[str, Any]:
    """An access-log line of a streamed chat request."""
    return {"arrival": arrival, "endpoint": "/v1/chat/completions", "model": MODEL,
            "stream": True, "prompt_tokens": prompt, "output_tokens": output, **conversation}  # fmt: skip


def test_a_later_turn_is_due_its_gap_after_its_answer_not_after_unrelated_requests(
    tmp_path: Path,
) -> None:
    """Turn 2 of c1 follows turn 1 (about 0.2 s long) by 0.3 s; a request of no
    conversation is due at 1.5 s, between them in arrival order. Timing the turn from the
    loop's wake for that request (or from when its position came up) sends it at 1.8 s."""
    lines = [
        entry(100.0, 30, 10, conversation="c1", turn=1),
        entry(101.5, 20, 3),
        entry(105.0, 70, 5, conversation="c1", turn=2, turn_gap_ms=300),
    ]
    log = tmp_path / "access.log"
    log.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    app = create_sim_app(SimConfig(models=(MODEL,), ttft=0.1, tokens_per_second=100))
    server = ThreadedServer(app).start()
    try:
        out = tmp_path / "run.json"
        result = subprocess.run(
            [sys.executable, "-m", "proxy.bench", "replay", str(log), "--url", server.url,
             "--out", str(out), "--quiet"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        server.stop()
    assert result.returncode == 0, result.stderr
    records = {r["index"]: r for r in orjson.loads(out.read_bytes())["records"]}
    first_ended = records[0]["scheduled"] + records[0]["e2e"]
    gap = records[2]["scheduled"] - first_ended
    assert 0.3 - 0.01 <= gap <= 0.3 + SLACK, gap
