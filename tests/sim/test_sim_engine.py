"""The simulator's vLLM 0.32 per-request metrics object and system_fingerprint placement,
checked against the shape of real vLLM 0.32 captures (tests/fixtures/streams/vllm-0.32)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import orjson
import pytest

from proxy.core.engine import engine_metrics
from proxy.sim.app import SimApp, create_sim_app
from proxy.sim.config import SimConfig
from proxy.sim.engine import Spec, metrics_json
from proxy.sim.tokens import completion_text
from tests.paths import STREAMS
from tests.servers import ThreadedServer

CHAT = "/v1/chat/completions"
FP = "vllm-0.32.0-sim"


@pytest.fixture(scope="module")
def sim() -> Iterator[tuple[ThreadedServer, SimApp]]:
    config = SimConfig(
        ttft=0.01, tokens_per_second=1000.0, output_tokens=6, per_request_metrics=True,
        system_fingerprint=FP,
    )  # fmt: skip
    app = create_sim_app(config)
    server = ThreadedServer(app).start()
    yield server, app
    server.stop()


def events(body: bytes) -> list[bytes]:
    return [e for e in body.split(b"\n\n") if e]


def chat(client: httpx.Client, url: str, usage: bool, **headers: str) -> list[bytes]:
    body: dict[str, object] = {"model": "sim-model", "stream": True, "messages": []}
    if usage:
        body["stream_options"] = {"include_usage": True}
    return events(client.post(url + CHAT, json=body, headers=headers).content)


def test_the_fingerprint_is_on_the_finish_chunk_without_usage(
    client: httpx.Client, url: str
) -> None:
    finish, done = chat(client, url, usage=False)[-2:]
    assert done == b"data: [DONE]"
    assert finish.endswith(
        b'"stop_reason":null,"token_ids":null}],"system_fingerprint":"' + FP.encode() + b'"}'
    )


def test_with_usage_the_fingerprint_and_metrics_ride_on_the_usage_chunk(
    client: httpx.Client,
    url: str,
) -> None:
    finish, usage = chat(client, url, usage=True)[-3:-1]
    assert b"system_fingerprint" not in finish
    # vLLM 0.32's member order on the usage chunk: choices, usage, system_fingerprint, metrics.
    real = next(
        e
        for e in events((STREAMS / "vllm-0.32/chat_stream_include_usage.sse").read_bytes())
        if b'"choices":[]' in e
    )
    order = [
        b'"choices":[]',
        b'"usage":',
        b'"system_fingerprint":',
        b'"metrics":{"time_to_first_token_ms":',
    ]
    for event in (real, usage):
        positions = [event.index(k) for k in order]
        assert positions == sorted(positions)
    m = engine_metrics(orjson.loads(usage.removeprefix(b"data: "))["metrics"])
    assert m is not None and m.time_to_first_token is not None and m.queue_time == 0.0


def test_programmed_speculative_decoding_sends_several_tokens_per_chunk(
    client: httpx.Client,
    url: str,
) -> None:
    headers = {"x-sim-spec-tokens": "3", "x-sim-acceptance-rate": "1", "x-sim-output-tokens": "10"}
    got = chat(client, url, usage=True, **headers)
    content = [e for e in got if b'"delta":{"content":"' in e and b'"finish_reason":null' in e]
    # 4 + 4 tokens, then a step of the last 2 and the EOS, whose chunk carries the finish
    assert len(content) == 2
    last = orjson.loads(got[-3].removeprefix(b"data: "))["choices"][0]
    assert (last["delta"]["content"], last["finish_reason"]) == (completion_text(2, 8), "stop")
    spec = orjson.loads(got[-2].removeprefix(b"data: "))["metrics"]["speculative_decoding"]
    assert (
        spec["num_spec_steps"],
        spec["num_draft_tokens"],
        spec["num_accepted_draft_tokens"],
    ) == (3, 9, 8)
    assert spec["acceptance_histogram"] == [0, 0, 1, 2]


def test_the_non_streamed_body_ends_with_the_metrics_object(client: httpx.Client, url: str) -> None:
    body = client.post(url + CHAT, json={"model": "sim-model", "messages": []}).json()
    assert list(body)[-1] == "metrics" and body["metrics"]["speculative_decoding"] is None


def test_the_object_counts_follow_the_tokens_sent() -> None:
    obj = orjson.loads(
        metrics_json(
            queue=0.1,
            first_token=0.2,
            generation=0.3,
            output_tokens=20,
            chunks=7,
            spec=Spec(3, 2),
            null_spec=False,
        )
    )
    spec = obj["speculative_decoding"]
    assert (spec["num_accepted_draft_tokens"], spec["num_draft_tokens"]) == (13, 21)
    assert spec["mean_acceptance_length"] == pytest.approx(20 / 7)
    assert obj["queue_time_ms"] == pytest.approx(100.0)


def test_responses_completed_carries_the_metrics_after_user(client: httpx.Client, url: str) -> None:
    body = {"model": "sim-model", "stream": True, "input": "hi"}
    got = events(client.post(url + "/v1/responses", json=body).content)
    completed = orjson.loads(got[-1].split(b"data: ", 1)[1])["response"]
    keys = list(completed)
    assert keys.index("metrics") == keys.index("user") + 1  # as vLLM 0.32 (the real capture)
    m = engine_metrics(completed["metrics"])
    assert m is not None and m.queue_time is not None
    whole = client.post(url + "/v1/responses", json={**body, "stream": False}).json()
    assert whole["metrics"]["speculative_decoding"] is None
