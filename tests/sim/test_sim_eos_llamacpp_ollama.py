"""The EOS token in the llama.cpp and Ollama modes: generated after the text in a decode
step of its own, without text, and counted, as both real servers do.

llama-server runs process_token for the EOS (`n_decoded` counts it) before its EOG check
ends the slot (tools/server/server-context.cpp), and the final response follows at once;
the captures in tests/fixtures/streams/llamacpp/*eos* are the real binary's answers to a
grammar that allows two words and then only the EOS. Ollama on a GGUF model reports
llama-server's `timings` (ollama/ollama llm/llama_server.go: EvalCount = PredictN) and
sends no line for a partial without text. A length finish has no EOS in either.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import MODEL, Running
from tests.sim.test_sim_llamacpp import events, skeleton

FIXTURES = Path(__file__).parent.parent / "fixtures" / "streams" / "llamacpp"
INDEX = orjson.loads((FIXTURES / "index.json").read_bytes())
TEXT = 2  # the captures' text tokens: " upon upon"
STEP = 0.05  # seconds a decode step
FAST = {"x-sim-ttft": "0.02", "x-sim-tps": "500", "x-sim-output-tokens": str(TEXT)}
SLOW = {**FAST, "x-sim-tps": str(1 / STEP)}


@pytest.fixture
def sim(start_sim: Callable[..., Running]) -> Running:
    return start_sim(models=("tiny", MODEL), backend_kind="llamacpp")


def counts(payload: Any) -> list[int]:
    """The counts a llama-server answer gives its generated tokens."""
    got = [payload.get("tokens_predicted"), (payload.get("usage") or {}).get("completion_tokens")]
    got.append((payload.get("timings") or {}).get("predicted_n"))
    return [n for n in got if n is not None]


@pytest.mark.parametrize(
    "name",
    [
        "chat_stream_eos.sse",
        "chat_eos.json",
        "completions_stream_eos.sse",
        "native_completion_eos_stream.sse",
        "native_completion_eos.json",
    ],
)
def test_llamacpp_eos_answers_are_the_real_servers(sim: Running, name: str) -> None:
    """Event for event, and counted as the real server counts: 2 text tokens and the EOS."""
    request = INDEX["requests"][name]
    r = httpx.post(sim.url + request["path"], json=request["body"], headers=FAST)
    assert r.status_code == 200
    real = (FIXTURES / name).read_bytes()
    if name.endswith(".json"):
        got, want = orjson.loads(r.content), orjson.loads(real)
        assert skeleton(got) == skeleton(want)
        assert counts(got) == counts(want) == [TEXT + 1] * len(counts(want))
        if "tokens_cached" in want:  # the prompt and every generated token but the last
            assert got["tokens_cached"] == want["tokens_cached"]
        return
    got, want = events(r.content), events(real)
    assert [skeleton(e) for e in got] == [skeleton(e) for e in want]
    assert [counts(e) for e in got if isinstance(e, dict)] == [
        counts(e) for e in want if isinstance(e, dict)
    ]
    if name.startswith("native"):  # the EOS's own partial: no text, its id, counted
        eos, last = got[-2], got[-1]
        assert (eos["content"], eos["tokens"], eos["tokens_predicted"]) == ("", [2], TEXT + 1)
        assert (last["stop_type"], last["tokens_cached"]) == ("eos", want[-1]["tokens_cached"])


@pytest.mark.parametrize(
    ("n_predict", "stop_type", "predicted"),
    [(TEXT, "limit", TEXT), (TEXT + 1, "eos", TEXT + 1)],  # as the real binary answers
)
def test_llamacpp_eos_needs_room_under_n_predict(
    sim: Running, n_predict: int, stop_type: str, predicted: int
) -> None:
    body = {"prompt": "once upon", "n_predict": n_predict, "stream": True}
    got = events(httpx.post(sim.url + "/completion", json=body, headers=FAST).content)
    assert [e["tokens_predicted"] for e in got] == [*range(1, predicted + 1), predicted]
    assert (got[-1]["stop_type"], got[-1]["timings"]["predicted_n"]) == (stop_type, predicted)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/completion"])
def test_llamacpp_eos_is_a_decode_step_of_its_own(sim: Running, path: str) -> None:
    """The finish comes one step after the last text, and predicted_ms runs to it: TEXT
    gaps after the first token, predicted_n - 1 of them."""
    body: dict[str, Any] = {"model": "tiny", "stream": True, "prompt": "once upon"}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {}
    started, lines = timed_lines(sim.url + path, body)
    arrivals = [(at, orjson.loads(line[6:])) for at, line in lines if line.startswith("data: {")]

    def text(event: Any) -> Any:
        return (
            event["choices"][0]["delta"].get("content") if "choices" in event else event["content"]
        )

    texts = [at for at, event in arrivals if text(event)]
    finish_at, finish = arrivals[-1]
    assert len(texts) == TEXT and finish["timings"]["predicted_n"] == TEXT + 1
    assert_the_eos_has_its_step(
        started, texts[0], finish_at, finish["timings"]["predicted_ms"] / 1e3
    )


DUE = float(SLOW["x-sim-ttft"]) + TEXT * STEP  # the finish, from the request's arrival


def timed_lines(url: str, body: Any) -> tuple[float, list[tuple[float, str]]]:
    """A SLOW stream's lines with the instants they were read, and the instant the request
    left: on a connection opened before, so that instant is within a millisecond of the
    server's arrival (a client and a connection made on the way cost tens of ms, which
    would hide a missing step from the due-time check)."""
    with httpx.Client() as client:
        assert client.get(httpx.URL(url).copy_with(path="/health")).status_code == 200
        started = time.monotonic()
        with client.stream("POST", url, json=body, headers=SLOW) as r:
            return started, [(time.monotonic(), line) for line in r.iter_lines()]


def assert_the_eos_has_its_step(
    started: float, first_at: float, end_at: float, span: float
) -> None:
    """The finish came at the EOS's own step, and the server's span (first token to the
    finish) runs to it.

    Only bounds a loaded machine cannot break: the simulator paces by due times, so a late
    wake-up shortens the gaps after it, and a gap between two reads (the last text read 7 ms
    before the finish in CI) or a span the server measured from a late first token (72 ms
    for 100) proves nothing. A read comes no sooner than its due time: the finish is due
    TTFT + TEXT steps after the request (one step sooner without the EOS's step). The
    server sent its first token no later than the client read it, and its finish no sooner
    than due, so its span is at least `started + DUE - first_at` (a span stopped at the
    last text is a step short of that, unless the first read came a step late).
    """
    assert end_at - started >= DUE - 0.005
    assert span >= started + DUE - first_at - 0.005, (span, first_at - started)


def ollama_lines(raw: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in raw.split(b"\n") if line]


@pytest.mark.parametrize("path", ["/api/chat", "/api/generate"])
@pytest.mark.parametrize("stream", [True, False])
def test_ollama_eval_count_counts_the_eos(
    start_sim: Callable[..., Running], path: str, stream: bool
) -> None:
    sim = start_sim()
    body: dict[str, Any] = {"model": MODEL, "stream": stream}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if path == "/api/chat" else {}
    body |= {"prompt": "hi"} if path == "/api/generate" else {}
    got = ollama_lines(httpx.post(sim.url + path, json=body, headers=FAST).content)
    done = got[-1]
    assert len(got) == (TEXT + 1 if stream else 1)  # a line a text token, none for the EOS
    assert (done["done_reason"], done["eval_count"]) == ("stop", TEXT + 1)
    if path == "/api/generate":  # the prompt and the text, tokenized again: no EOS
        assert done["context"] == list(range(1, done["prompt_eval_count"] + TEXT + 1))
    assert sim.app.state.last().completion_tokens == TEXT + 1


def test_ollama_eos_needs_room_under_num_predict(start_sim: Callable[..., Running]) -> None:
    sim = start_sim()
    for limit, reason, count in ((TEXT, "length", TEXT), (TEXT + 1, "stop", TEXT + 1)):
        body = {"model": MODEL, "prompt": "hi", "stream": False, "options": {"num_predict": limit}}
        done = httpx.post(sim.url + "/api/generate", json=body, headers=FAST).json()
        assert (done["done_reason"], done["eval_count"]) == (reason, count)


def test_ollama_done_line_comes_at_the_eos_step(start_sim: Callable[..., Running]) -> None:
    sim = start_sim()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    started, lines = timed_lines(sim.url + "/api/chat", body)
    arrivals = [(at, orjson.loads(line)) for at, line in lines if line]
    (first_at, _), (done_at, done) = arrivals[0], arrivals[-1]
    assert len(arrivals) == TEXT + 1 and done["eval_count"] == TEXT + 1
    assert_the_eos_has_its_step(started, first_at, done_at, done["eval_duration"] / 1e9)
