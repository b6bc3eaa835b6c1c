"""The simulator in Ollama's shapes, more of ollama/ollama's server/routes.go and
server/sched.go (fb30760): raw generate, `/`, keep_alive 0 and /api/embed with no input."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import orjson
import pytest

from tests.conftest import MODEL, Running

FAST = {"x-sim-ttft": "0.02", "x-sim-tps": "500", "x-sim-output-tokens": "4"}
LOAD = 0.4


def done_line(body: bytes) -> dict[str, object]:
    parsed: dict[str, object] = orjson.loads(body.rstrip(b"\n").rpartition(b"\n")[2])
    return parsed


@pytest.mark.parametrize("stream", [True, False])
def test_a_raw_generate_has_no_context(start_sim: Callable[..., Running], stream: bool) -> None:
    # GenerateHandler: `if !req.Raw { ... res.Context = tokens }`
    sim = start_sim()
    ask = {"model": MODEL, "prompt": "hi", "stream": stream}
    raw = done_line(
        httpx.post(sim.url + "/api/generate", json=ask | {"raw": True}, headers=FAST).content
    )
    templated = done_line(httpx.post(sim.url + "/api/generate", json=ask, headers=FAST).content)
    assert raw["done"] is True and "context" not in raw
    assert "context" in templated


def test_the_root_says_ollama_is_running(start_sim: Callable[..., Running]) -> None:
    # GenerateRoutes: r.HEAD("/") and r.GET("/"): c.String(200, "Ollama is running"); the
    # Ollama CLI's first request is HEAD /
    sim = start_sim(ollama_version="0.13.0")
    got = httpx.get(sim.url + "/")
    assert (got.status_code, got.text) == (200, "Ollama is running")
    assert got.headers["content-type"] == "text/plain; charset=utf-8"
    assert httpx.head(sim.url + "/").status_code == 200


def test_vllms_root_stays_not_found(start_sim: Callable[..., Running]) -> None:
    sim = start_sim()
    assert [httpx.request(m, sim.url + "/").status_code for m in ("GET", "HEAD", "POST")] == [
        404
    ] * 3


def test_unloading_a_cold_model_loads_nothing(start_sim: Callable[..., Running]) -> None:
    # GenerateHandler and ChatHandler: no prompt (no messages) and keep_alive 0 call
    # s.sched.expireRunner(m) and answer, before any scheduleRunner
    sim = start_sim(ollama_load_time=LOAD)
    for path, body in (("/api/generate", {"prompt": ""}), ("/api/chat", {"messages": []})):
        began = time.monotonic()
        answer = httpx.post(sim.url + path, json={"model": MODEL, "keep_alive": 0, **body})
        assert answer.json()["done_reason"] == "unload"
        assert time.monotonic() - began < LOAD / 2, path


def test_keep_alive_zero_unloads_after_the_answer(start_sim: Callable[..., Running]) -> None:
    # server/sched.go processCompleted: a runner whose sessionDuration is 0 expires once its
    # requests are done, so the next request loads the model again
    sim = start_sim(ollama_load_time=LOAD)
    ask = {"model": MODEL, "prompt": "hi", "stream": False}

    def load_ns(**extra: object) -> int:
        answer = httpx.post(sim.url + "/api/generate", json=ask | extra, headers=FAST).json()
        return int(answer.get("load_duration", 0))

    assert load_ns() >= LOAD * 1e9  # cold
    assert load_ns() < LOAD * 1e9 / 2  # warm
    assert load_ns(keep_alive=0) < LOAD * 1e9 / 2  # warm, and unloaded after it
    assert load_ns() >= LOAD * 1e9  # cold again
    httpx.post(sim.url + "/api/generate", json={"model": MODEL, "keep_alive": 0})
    assert load_ns() >= LOAD * 1e9  # an unload request unloads a loaded model


@pytest.mark.parametrize("given", [{"input": ""}, {"input": []}, {}])
def test_embed_with_no_input_answers_no_embeddings(
    start_sim: Callable[..., Running], given: dict[str, object]
) -> None:
    # EmbedHandler: `""` is no input (`if len(i) > 0`), neither is a null one; after the
    # model is scheduled `len(input) == 0` answers EmbedResponse{Model, Embeddings: {}},
    # the durations and count zero and omitted
    sim = start_sim()
    answer = httpx.post(sim.url + "/api/embed", json={"model": MODEL, **given})
    assert answer.status_code == 200
    assert answer.content == b'{"model":"%s","embeddings":[]}' % MODEL.encode()


def test_embed_of_a_number_is_still_refused(start_sim: Callable[..., Running]) -> None:
    answer = httpx.post(start_sim().url + "/api/embed", json={"model": MODEL, "input": 3})
    assert (answer.status_code, answer.json()) == (400, {"error": "invalid input type"})
