"""The simulator's routes added by issue 18, on a real uvicorn server: generate's chunks in
the member order of a real vLLM 0.32 capture, the audio forms' validation, and the realtime
session's answers to bad input, as vLLM's connection.py gives them."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import orjson
import pytest

from proxy.sim import SimApp, SimConfig
from proxy.sim.generate import token_ids
from tests.paths import STREAMS
from tests.servers import ThreadedServer
from tests.sim.test_sim_support import running

MODEL = "sim-model"


@pytest.fixture(scope="module")
def sim() -> Iterator[tuple[ThreadedServer, SimApp]]:
    config = SimConfig(models=(MODEL,), ttft=0.01, tokens_per_second=1000, output_tokens=5)
    with running(config) as pair:
        yield pair


def payloads(raw: bytes) -> list[bytes]:
    return [e[6:] for e in raw.split(b"\n\n") if e.startswith(b"data: {")]


def keys(obj: object) -> object:
    """The member names in order, all the way down (values left out)."""
    if isinstance(obj, dict):
        return [(k, keys(v)) for k, v in obj.items()]
    if isinstance(obj, list):
        return [keys(v) for v in obj[:1]]
    return None


def test_generate_chunks_have_the_real_captures_members_in_its_order(url: str) -> None:
    body = {"model": MODEL, "stream": True, "token_ids": [1, 2, 3, 4, 5],
            "sampling_params": {"max_tokens": 5, "ignore_eos": True}}  # fmt: skip
    raw = httpx.post(url + "/inference/v1/generate", json=body).content
    real = payloads((STREAMS / "vllm032_generate.sse").read_bytes())
    ours = payloads(raw)
    assert len(ours) == len(real) == 5 and raw.endswith(b"data: [DONE]\n\n")
    # the first chunk carries no weight_versions in either; compare members, not values
    assert [keys(orjson.loads(p)) for p in ours[:-1]] == [keys(orjson.loads(p)) for p in real[:-1]]
    last = orjson.loads(ours[-1])["choices"][0]
    assert last["finish_reason"] == "length"
    assert [i for p in ours for i in orjson.loads(p)["choices"][0]["token_ids"]] == token_ids(5)


def test_generate_without_token_ids_is_a_400(url: str) -> None:
    r = httpx.post(url + "/inference/v1/generate", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 400 and "token_ids" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("content", "headers", "why"),
    [
        (b"not a form", {"content-type": "text/plain"}, "Invalid multipart"),
        (
            b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nsim-model\r\n--b--\r\n',
            {"content-type": "multipart/form-data; boundary=b"},
            "Field required: file",
        ),
    ],
)
def test_audio_forms_that_vllm_would_refuse_are_400s(
    url: str, content: bytes, headers: dict[str, str], why: str
) -> None:
    r = httpx.post(url + "/v1/audio/transcriptions", content=content, headers=headers)
    assert r.status_code == 400 and why in r.json()["error"]["message"]


def test_realtime_answers_bad_input_as_vllm_does(url: str) -> None:
    from websockets.sync.client import connect

    with connect(url.replace("http://", "ws://") + "/v1/realtime") as ws:
        created = orjson.loads(ws.recv(timeout=5))
        assert created["type"] == "session.created" and created["id"].startswith("sess-")
        answers = []
        for frame in ('{"type": "input_audio_buffer.commit"}', "{oops", '{"type": "nope"}',
                      '{"type": "session.update", "model": "other"}'):  # fmt: skip
            ws.send(frame)
            answers.append(orjson.loads(ws.recv(timeout=5))["code"])
    assert answers == ["model_not_validated", "invalid_json", "unknown_event", "model_not_found"]
