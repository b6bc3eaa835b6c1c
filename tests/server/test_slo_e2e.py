"""`--slo` end to end: the simulator is told each request's latencies, the proxy judges
them, and the share that met every target is the programmed share, per target, per model
and per --label-header team. Latencies sit far from the limits (a met request's TTFT is
~0, a missed one's 0.8 s against a 0.4 s limit), so a loaded machine cannot move them
across."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from proxy.core.labels import MAX_MODELS
from proxy.settings import SettingsError, parse
from tests.conftest import ProxyUnderTest, Running
from tests.paths import FIXTURES
from tests.server.conftest import no_proxy
from tests.servers import serve, spawn, stop

MODELS = ("fast", "slow")
QUICK = {"x-sim-ttft": "0", "x-sim-tps": "5000"}
LATE_FIRST_TOKEN = {"x-sim-ttft": "0.8", "x-sim-tps": "5000"}
SLOW_TOKENS = {"x-sim-ttft": "0", "x-sim-tps": "10"}  # tpot 0.1 s > 0.04 s
ERROR = {"x-sim-error": "server_error"}  # a 500: the service failed

#: (model, team, headers, how many): 10 requests of team a, 4 met; 10 of team b, 7 met;
#: the slow model has its own e2e target from the file: 5 of 6 miss it.
PLAN = [
    ("fast", "a", QUICK, 4),
    ("fast", "a", LATE_FIRST_TOKEN, 3),
    ("fast", "a", SLOW_TOKENS, 2),
    ("fast", "a", ERROR, 1),
    ("fast", "b", QUICK, 7),
    ("fast", "b", LATE_FIRST_TOKEN, 1),
    ("fast", "b", SLOW_TOKENS, 2),
    ("slow", "a", QUICK, 1),
    ("slow", "a", SLOW_TOKENS, 5),  # 4 tokens at 10/s: e2e >= 0.3 s > 0.25 s
]


async def _send(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:

        async def one(model: str, team: str, headers: dict[str, str]) -> None:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                "max_tokens": 4,
            }
            async with client.stream(
                "POST", "/v1/chat/completions", json=body, headers={"x-team": team, **headers}
            ) as response:
                await response.aread()

        await asyncio.gather(*(one(m, t, h) for m, t, h, n in PLAN for _ in range(n)))


def _results(proxy: ProxyUnderTest, model: str, team: str) -> dict[str, float]:
    labels = {"model": model, "endpoint": "/v1/chat/completions", "team": team}
    return {
        r: proxy.sample("tokenprobe_slo_requests_total", **labels, result=r)
        for r in ("met", "ttft", "tpot", "e2e", "error")
    }


@pytest.mark.quiet(
    "programmed delays must meet or miss targets by margins of tens of ms", seconds=1
)
def test_attainment_is_the_programmed_share_per_target_model_and_team(
    start_sim: Callable[..., Running],
    start_proxy: Callable[..., ProxyUnderTest],
    tmp_path: Path,
) -> None:
    sim = start_sim(models=MODELS, output_tokens=4)
    slo_file = tmp_path / "slo.yaml"
    slo_file.write_text(yaml.safe_dump({"models": {"slow": {"e2e": 0.25}}}))
    proxy = start_proxy(
        sim.url,
        model_allowlist=MODELS,
        slo="ttft=0.4,tpot=0.04",
        slo_file=str(slo_file),
        label_header=("x-team=team",),
    )
    asyncio.run(_send(proxy.url))
    proxy.wait_records(sum(n for *_, n in PLAN), timeout=20)

    assert _results(proxy, "fast", "a") == {"met": 4, "ttft": 3, "tpot": 2, "e2e": 0, "error": 1}
    assert _results(proxy, "fast", "b") == {"met": 7, "ttft": 1, "tpot": 2, "e2e": 0, "error": 0}
    # The slow model's targets are the file's (e2e only): its tpot is not judged.
    assert _results(proxy, "slow", "a") == {"met": 1, "ttft": 0, "tpot": 0, "e2e": 5, "error": 0}
    # Goodput tokens: 4 output tokens per met request.
    goodput = proxy.sample(
        "tokenprobe_goodput_tokens_total", model="fast", endpoint="/v1/chat/completions", team="b"
    )
    assert goodput == 7 * 4
    text = httpx.get(proxy.url + "/metrics").text
    assert 'tokenprobe_slo_requests_total{endpoint="/v1/chat/completions",model="fast"' in text


def test_a_cancelled_stream_is_counted_apart_and_left_out_of_attainment(
    start_sim: Callable[..., Running], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    sim = start_sim(output_tokens=400, tokens_per_second=20)
    proxy = start_proxy(sim.url, slo="e2e=60")
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with (
        httpx.Client(base_url=proxy.url, timeout=30) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        next(response.iter_raw())  # the first bytes, then walk away
    proxy.wait_records(1, timeout=20)
    labels = {"model": "sim-model", "endpoint": "/v1/chat/completions"}
    assert proxy.sample("tokenprobe_slo_cancelled_requests_total", **labels) == 1
    for result in ("met", "ttft", "tpot", "e2e", "error"):
        assert proxy.sample("tokenprobe_slo_requests_total", **labels, result=result) == 0


@pytest.mark.quiet("a late answer must miss a 0.4 s limit, a quick one meet it", seconds=1)
def test_a_non_streamed_answers_first_token_is_judged_by_its_end(
    start_sim: Callable[..., Running], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """Its client gets the first token with the whole answer: a ttft target judges its e2e.
    Judged by nothing, it met a TTFT-only objective however late (tpot is not judged: a
    non-streamed answer has no first token apart from its last)."""
    sim = start_sim(output_tokens=4)
    proxy = start_proxy(sim.url, slo="ttft=0.4,tpot=0.001")
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        for headers in (QUICK, LATE_FIRST_TOKEN, LATE_FIRST_TOKEN):
            response = client.post("/v1/chat/completions", json=body, headers=headers)
            assert response.status_code == 200, response.text
    quick, *_ = proxy.wait_records(3, timeout=20)
    assert quick.ttft is None and quick.output_tokens  # no first token apart from the body
    labels = {"model": "sim-model", "endpoint": "/v1/chat/completions"}
    judged = {
        result: proxy.sample("tokenprobe_slo_requests_total", **labels, result=result)
        for result in ("met", "ttft", "tpot")
    }
    assert judged == {"met": 1, "ttft": 2, "tpot": 0}
    assert proxy.sample("tokenprobe_goodput_tokens_total", **labels) == quick.output_tokens


def test_requests_refused_for_the_clients_doing_are_not_judged_and_a_429_is_an_error(
    start_sim: Callable[..., Running], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """A bad key, an unknown model, a prompt over the context: the service broke no
    promise, so the SLO burn alert must not page for them; throttling is the service's."""
    sim = start_sim()
    proxy = start_proxy(sim.url, slo="e2e=60")
    refused = ("auth", "forbidden", "not_found", "context_length", "bad_request")
    failed = ("rate_limit", "server_error", "token_exchange")
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        for forced in (*refused, *failed):
            response = client.post(
                "/v1/chat/completions", json=body, headers={"x-sim-error": forced}
            )
            assert response.status_code >= 400, forced
        assert client.post("/v1/chat/completions", json=body).status_code == 200
    records = proxy.wait_records(len(refused) + len(failed) + 1, timeout=20)
    labels = {"model": "sim-model", "endpoint": "/v1/chat/completions"}
    judged = {
        result: proxy.sample("tokenprobe_slo_requests_total", **labels, result=result)
        for result in ("met", "error")
    }
    assert judged == {"met": 1, "error": len(failed)}
    assert proxy.sample("tokenprobe_slo_cancelled_requests_total", **labels) == 0
    refusals = sorted(str(r.error_type) for r in records if 400 <= r.status_code < 500)
    assert refusals == ["auth", "auth", "bad_request", "context_length", "not_found", "rate_limit"]


def test_an_slo_file_naming_thousands_of_models_keeps_the_model_label_bound(
    start_sim: Callable[..., Running],
    start_proxy: Callable[..., ProxyUnderTest],
    tmp_path: Path,
) -> None:
    names = [f"model-{i}" for i in range(5000)]
    sim = start_sim(models=tuple(names), output_tokens=2, ttft=0.0, tokens_per_second=5000)
    slo_file = tmp_path / "slo.yaml"
    slo_file.write_text(yaml.safe_dump({"models": {n: {"e2e": 30} for n in names}}))
    proxy = start_proxy(sim.url, model_allowlist=(), slo_file=str(slo_file))
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        for name in names[: MAX_MODELS + 50 : 25]:
            body = {"model": name, "messages": [{"role": "user", "content": "hi"}]}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
    proxy.wait_records(len(names[: MAX_MODELS + 50 : 25]), timeout=20)
    models = {
        s.labels["model"]
        for family in proxy.registry.collect()
        if family.name == "tokenprobe_slo_requests"
        for s in family.samples
    }
    # Judged against each model's own target, but labelled as the bounded model label:
    # nothing is allowlisted or listed upstream here, so every one is "other".
    assert models == {"other"}
    met = proxy.sample(
        "tokenprobe_slo_requests_total",
        model="other",
        endpoint="/v1/chat/completions",
        result="met",
    )
    assert met == len(names[: MAX_MODELS + 50 : 25])


@no_proxy
@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--slo", "ttft=soon"], "--slo='ttft=soon': ttft is not a number: 'soon'"),
        (["--slo", "latency=1"], "expected NAME=SECONDS with NAME in ttft, ttfa, tpot, e2e"),
        (["--slo-file", "{file}"], "models.big: tpot must be a positive number of seconds"),
        (["--slo-file", "/no/such/slo.yaml"], "cannot read the SLO file"),
        (["--slo-file", "{broken}"], "cannot read the SLO file: while parsing a flow mapping"),
    ],
)
def test_a_malformed_slo_refuses_to_start_with_a_clear_message(
    flags: list[str], says: str, tmp_path: Path
) -> None:
    bad = tmp_path / "slo.yaml"
    bad.write_text("models:\n  big: {tpot: -1}\n")
    broken = tmp_path / "broken.yaml"  # not YAML at all: the flow mapping never closes
    broken.write_text("models:\n  big: {tpot: 1\n")
    argv = [
        "--upstream",
        "http://127.0.0.1:9",
        *(f.format(file=bad, broken=broken) for f in flags),
    ]
    with pytest.raises(SettingsError, match=None) as caught:
        parse(argv, {})
    assert says in str(caught.value)
    process = spawn("serve", *argv)
    try:
        _, err = process.communicate(timeout=30)
    finally:
        stop(process)
    assert process.returncode == 2
    assert says in err.decode()


#: A real vLLM 0.32 chat answer, not streamed, cut by max_tokens 40 inside its reasoning:
#: `content` null (vllm/reasoning/basic_parsers.py:170-171, no end of thinking).
REASONING_ONLY = FIXTURES / "streams" / "vllm-0.32" / "reasoning_only_chat_nonstream.json"
#: vLLM's answer to `background: true` not streamed, at once: the response queued, no
#: output, no usage; it generates later (openai/responses/serving.py:537-590).
QUEUED = {"id": "resp_1", "object": "response", "created_at": 1796649217, "model": "tiny",
          "output": [], "status": "queued", "usage": None, "background": True,
          "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}  # fmt: skip


async def vllm_not_streamed(
    scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]
) -> None:
    """The two bodies above, by path: a reasoning-only answer not streamed, which the
    simulator does not serve (it reasons only in streams), and vLLM's own `queued`
    acknowledgement of a background request."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    queued = scope["path"] == "/v1/responses"
    body = json.dumps(QUEUED).encode() if queued else REASONING_ONLY.read_bytes()
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def vllm_bodies() -> Iterator[str]:
    with serve(vllm_not_streamed) as server:
        yield server.url


def test_a_non_streamed_answer_of_reasoning_alone_misses_its_ttfa_target(
    vllm_bodies: str, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """Its client got no answer, as a stream cut inside its reasoning gives none: a ttfa
    target is missed however quick the body came (it met it once: no first answer judged
    by its e2e, well inside the limit)."""
    proxy = start_proxy(vllm_bodies, model_allowlist=("tiny",), slo="ttfa=30")
    body = {"model": "tiny", "max_tokens": 40, "messages": [{"role": "user", "content": "hi"}]}
    response = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    (m,) = proxy.wait_records(1, timeout=20)
    assert (m.stream, m.without_answer) == (False, "length")
    labels = {"model": "tiny", "endpoint": "/v1/chat/completions"}
    judged = {
        result: proxy.sample("tokenprobe_slo_requests_total", **labels, result=result)
        for result in ("met", "ttfa")
    }
    assert judged == {"met": 0, "ttfa": 1}
    assert proxy.sample("tokenprobe_requests_without_answer_total", **labels, reason="length") == 1


def test_a_background_acknowledgement_is_not_judged_met(
    vllm_bodies: str, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """`queued` in milliseconds is no kept promise: the response had not begun. Counted
    apart as a stream of it its client left is, out of attainment and goodput."""
    proxy = start_proxy(vllm_bodies, model_allowlist=("tiny",), slo="ttft=30")
    body = {"model": "tiny", "input": "hi", "background": True}
    response = httpx.post(proxy.url + "/v1/responses", json=body, timeout=30)
    assert response.status_code == 200 and response.json()["status"] == "queued"
    (m,) = proxy.wait_records(1, timeout=20)
    assert m.raw_finish_reason == "queued"
    labels = {"model": "tiny", "endpoint": "/v1/responses"}
    assert proxy.sample("tokenprobe_slo_cancelled_requests_total", **labels) == 1
    assert proxy.sample("tokenprobe_slo_requests_total", **labels, result="met") == 0
