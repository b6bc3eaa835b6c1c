"""The simulator in Ollama's shapes, checked against ollama/ollama's source (api/types.go
field order, server/routes.go content types, errors and the load/unload answers)."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import orjson

from tests.conftest import MODEL, Running

FAST = {"x-sim-ttft": "0.02", "x-sim-tps": "500", "x-sim-output-tokens": "4"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}


def lines(body: bytes) -> list[dict[str, object]]:
    return [orjson.loads(line) for line in body.split(b"\n") if line]


def test_chat_stream_lines_in_go_field_order(start_sim: Callable[..., Running]) -> None:
    sim = start_sim()
    r = httpx.post(sim.url + "/api/chat", json=CHAT, headers=FAST)
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
    assert r.content.endswith(b"}\n") and r.content.count(b"\n") == 5
    objs = lines(r.content)
    assert [list(o) for o in objs[:4]] == [["model", "created_at", "message", "done"]] * 4
    assert all(o["done"] is False for o in objs[:4])
    done = objs[-1]
    assert list(done) == [
        "model", "created_at", "message", "done", "done_reason", "total_duration",
        "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count",
        "eval_duration",
    ]  # fmt: skip
    # 4 content lines; eval_count counts the EOS too (llama-server's predicted_n), which
    # has no line of its own
    assert done["done_reason"] == "stop" and done["eval_count"] == 5
    assert all(type(done[k]) is int for k in ("total_duration", "load_duration", "eval_duration"))
    assert str(done["created_at"]).endswith("Z")


def test_not_streamed_is_one_json_object_with_the_whole_text(
    start_sim: Callable[..., Running],
) -> None:
    sim = start_sim()
    r = httpx.post(
        sim.url + "/api/generate",
        json={"model": MODEL, "prompt": "hi", "stream": False},
        headers=FAST,
    )
    assert r.headers["content-type"] == "application/json; charset=utf-8"
    obj = r.json()
    # 4 text tokens and the EOS; `context` is the prompt and the text tokenized again
    assert obj["done"] is True and obj["response"] and obj["eval_count"] == 5
    assert obj["context"] == list(range(1, obj["prompt_eval_count"] + 4 + 1))
    assert obj["prompt_eval_duration"] >= 0.02e9 * 0.9


def test_a_cold_model_waits_its_load_once(start_sim: Callable[..., Running]) -> None:
    sim = start_sim(ollama_load_time=0.3)
    began = time.monotonic()
    cold = lines(httpx.post(sim.url + "/api/chat", json=CHAT, headers=FAST).content)[-1]
    assert time.monotonic() - began >= 0.3
    warm = lines(httpx.post(sim.url + "/api/chat", json=CHAT, headers=FAST).content)[-1]
    assert int(str(cold["load_duration"])) >= 0.3e9 > int(str(warm["load_duration"]))


def test_empty_prompt_loads_or_unloads(start_sim: Callable[..., Running]) -> None:
    sim = start_sim()
    load = httpx.post(sim.url + "/api/generate", json={"model": MODEL}).json()
    unload = httpx.post(sim.url + "/api/generate", json={"model": MODEL, "keep_alive": 0}).json()
    assert (load["done_reason"], unload["done_reason"]) == ("load", "unload")
    assert "eval_count" not in load and load["response"] == ""
    # ChatHandler: no messages loads, with keep_alive zero (a number of seconds or a Go
    # duration: "0s", "0m") unloads, answering an empty assistant message
    chat = {"model": MODEL, "messages": []}
    for keep, reason in ((None, "load"), ("0s", "unload"), ("0m", "unload"), ("5m", "load")):
        body = chat if keep is None else {**chat, "keep_alive": keep}
        answer = httpx.post(sim.url + "/api/chat", json=body).json()
        assert (answer["done_reason"], answer["done"]) == (reason, True), keep
        assert answer["message"] == {"role": "assistant", "content": ""}
    unload = httpx.post(sim.url + "/api/generate", json={"model": MODEL, "keep_alive": "0s"})
    assert unload.json()["done_reason"] == "unload"


def test_errors_are_ollamas(start_sim: Callable[..., Running]) -> None:
    sim = start_sim(max_model_len=16)
    missing = httpx.post(sim.url + "/api/chat", json={**CHAT, "model": "llama3"})
    assert (missing.status_code, missing.json()) == (404, {"error": "model 'llama3' not found"})
    long = {**CHAT, "messages": [{"role": "user", "content": "x" * 400}], "shift": False}
    over = httpx.post(sim.url + "/api/chat", json=long)
    assert over.status_code == 400 and "longer than the context length" in over.json()["error"]
    mid = httpx.post(
        sim.url + "/api/chat",
        json=CHAT,
        headers={**FAST, "x-sim-fault": "error_event", "x-sim-fault-after": "2"},
    )
    assert mid.status_code == 200 and list(lines(mid.content)[-1]) == ["error"]


def test_num_predict_is_capped_and_only_the_prompt_meets_the_context(
    start_sim: Callable[..., Running],
) -> None:
    # ollama/ollama llm/llama_server.go: boundedNumPredict caps num_predict at 10 contexts
    # (unset: open-ended, so 10 contexts too) and nothing checks it against the context; a
    # prompt of num_ctx tokens or more is refused only with context shift off, else cut
    # to contextShiftPromptLimit (num_keep 4 kept: 16 - (16 - 4) // 2 = 10 tokens)
    sim = start_sim(max_model_len=16)
    fast = {**FAST, "x-sim-tps": "5000"}
    one = {**CHAT, "stream": False, "options": {"num_predict": 5000}}
    short = httpx.post(sim.url + "/api/chat", json=one, headers=fast)
    assert short.status_code == 200 and short.json()["eval_count"] == 5  # 4 and the EOS
    endless = httpx.post(
        sim.url + "/api/chat",
        json={**CHAT, "stream": False},
        headers={**fast, "x-sim-output-tokens": "500"},
    ).json()
    assert (endless["eval_count"], endless["done_reason"]) == (160, "length")
    long = {**one, "messages": [{"role": "user", "content": "x" * 400}]}
    shifted = httpx.post(sim.url + "/api/chat", json=long, headers=fast)
    assert shifted.status_code == 200 and shifted.json()["prompt_eval_count"] == 10
    refused = httpx.post(sim.url + "/api/chat", json={**long, "shift": False}, headers=fast)
    assert refused.status_code == 400


def test_version_only_when_playing_ollama(start_sim: Callable[..., Running]) -> None:
    assert httpx.get(start_sim().url + "/api/version").status_code == 404
    r = httpx.get(start_sim(ollama_version="0.13.0").url + "/api/version")
    assert r.json() == {"version": "0.13.0"}


def test_embed_counts_every_input(start_sim: Callable[..., Running]) -> None:
    sim = start_sim()
    r = httpx.post(sim.url + "/api/embed", json={"model": MODEL, "input": ["abcd", "efghij"]})
    obj = r.json()
    assert list(obj) == [
        "model",
        "embeddings",
        "total_duration",
        "load_duration",
        "prompt_eval_count",
    ]
    assert len(obj["embeddings"]) == 2 and obj["prompt_eval_count"] == 3
