"""Background Responses through the proxy in front of the simulator.

vLLM 0.32 generates a `background: true` response in a task of its own
(vllm/entrypoints/openai/responses/serving.py:537-589): not streamed, the POST answers at
once with the response `queued`; streamed, a client that leaves the POST's stream stops
only its reading. The response is stored: `GET /v1/responses/{id}` answers it (`queued`
until it is done, then with its usage, serving.py:928-932), and `?stream=true
&starting_after=N` reads its events again up to `response.completed` with the whole usage
(serving.py:1104-1131; api_router.py:80-107).

So the POST whose answer ended first keeps its one record without tokens (no error, no
finish yet, no SLO verdict of met), and the first retrieval through the same proxy that
sees the response finished adds its tokens to the token counters, with the POST's labels
(proxy/core/background.py). Every retrieval stays a passthrough by route; a second
retrieval counts nothing, nor does one of a response this proxy did not start.
"""

from __future__ import annotations

import io
import json
import re
import socket
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import httpx

from proxy.sinks.logs import AccessLog
from proxy.sinks.sink import Recorder
from tests.conftest import MODEL, ProxyUnderTest, Running

PROGRAM = b"x-sim-output-tokens: 30\r\nx-sim-tps: 60\r\n"
OUTPUT = 31  # the 30 programmed and the EOS, as vLLM's usage counts them
HEADERS = {"x-sim-output-tokens": "30", "x-sim-tps": "60"}  # PROGRAM, for httpx


def leave_after(url: str, events: int, headers: bytes = b"") -> str:
    """POST a background stream, read `events` events and at least its first text delta
    (so the proxy read the model's first token before the client left: the item and part
    events come in the same write as it, but a read may end between them), leave; the
    response's id."""
    body = json.dumps({"model": MODEL, "input": "hi", "background": True, "stream": True})
    where = urlsplit(url)
    with socket.create_connection((where.hostname, where.port)) as s:
        s.sendall(
            b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + PROGRAM
            + headers
            + b"Content-Length: %d\r\n\r\n" % len(body)
            + body.encode()
        )
        got = b""
        while got.count(b"data: ") < events or b'"response.output_text.delta"' not in got:
            more = s.recv(65536)
            assert more, got  # the stream ended before its first text
            got += more
    found = re.search(rb'"id":"(resp_[^"]+)"', got)
    assert found is not None
    return found.group(1).decode()


def read_whole(url: str) -> str:
    """POST a background stream and read it to its end; the response's id."""
    body = {"model": MODEL, "input": "hi", "background": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/responses", json=body, headers=HEADERS) as r:
        text = "".join(r.iter_text())
    assert r.status_code == 200 and '"type":"response.completed"' in text
    found = re.search(r'"id":"(resp_[^"]+)"', text)
    assert found is not None
    return found.group(1)


def test_a_left_stream_is_counted_once_by_the_first_retrieval_that_sees_it_finished(
    start_proxy: Callable[..., ProxyUnderTest], sim: Running
) -> None:
    """A retrieval its reader left counts nothing; the first read whole counts the usage
    once, with the POST's labels (its team header, which no GET carries); the retrievals
    after it count nothing more. Each GET is a passthrough, no request of its own."""
    late = Recorder()
    proxy = start_proxy(sim.url, sinks=[late], label_header=("x-team=team",))
    rid = leave_after(proxy.url, 4, b"x-team: red\r\n")
    with httpx.stream("GET", f"{proxy.url}/v1/responses/{rid}", params={"stream": "true"}) as r:
        for line in r.iter_lines():
            if '"response.output_text.delta"' in line:
                break  # its reader leaves before the end: nothing counted
    replay = httpx.get(f"{proxy.url}/v1/responses/{rid}", params={"stream": "true"})
    assert replay.status_code == 200 and '"type":"response.completed"' in replay.text
    after = httpx.get(
        f"{proxy.url}/v1/responses/{rid}", params={"stream": "1", "starting_after": 3}
    )
    assert '"type":"response.completed"' in after.text
    whole = httpx.get(f"{proxy.url}/v1/responses/{rid}")
    assert whole.status_code == 200 and whole.json()["status"] == "completed"
    assert passthrough(proxy, "/v1/responses/{id}", "200", at_least=4) == 4
    (post,) = proxy.wait_records(1, exact=True)
    assert (post.endpoint, post.output_tokens, post.raw_finish_reason) == (
        "/v1/responses",
        None,
        "in_progress",
    )
    (counted,) = late.late
    assert (counted.response_id, counted.counted_by, counted.output_tokens) == (
        rid,
        "retrieve_stream",
        OUTPUT,
    )
    details = whole.json()["usage"]["input_tokens_details"]  # vLLM always writes both
    assert (counted.cached_prompt_tokens, counted.cache_write_tokens) == (
        details["cached_tokens"],
        details["cache_write_tokens"],
    )
    labels = {"model": MODEL, "endpoint": "/v1/responses", "team": "red", "source": "usage"}
    assert proxy.sample("tokenprobe_generation_tokens_total", **labels) == OUTPUT
    assert proxy.sample("tokenprobe_prompt_tokens_total", **labels) == counted.prompt_tokens
    assert generation_tokens(proxy) == OUTPUT
    assert requests(proxy) == 1  # the POST's


def test_a_background_response_not_streamed_is_counted_once_by_polling(
    start_proxy: Callable[..., ProxyUnderTest], sim: Running
) -> None:
    """The POST is answered `queued` at once: its record has no tokens. Polls that find it
    queued count nothing; the first that finds it completed counts its usage; later ones
    nothing more. No retrieval is a request: requests_total stays the POST's one."""
    log = io.StringIO()
    proxy = start_proxy(sim.url, sinks=[AccessLog("json", stream=log)])
    body = {"model": MODEL, "input": "hi", "background": True}
    queued = httpx.post(f"{proxy.url}/v1/responses", json=body, headers=HEADERS)
    assert queued.status_code == 200 and queued.json()["status"] == "queued"
    rid = queued.json()["id"]
    (post,) = proxy.wait_records(1, exact=True)
    assert (post.raw_finish_reason, post.output_tokens, post.response_id) == ("queued", None, rid)
    polls = 0
    deadline = time.monotonic() + 10
    while (got := httpx.get(f"{proxy.url}/v1/responses/{rid}").json())["status"] == "queued":
        polls += 1
        assert generation_tokens(proxy) == 0
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert polls and got["usage"]["output_tokens"] == OUTPUT
    again = httpx.get(f"{proxy.url}/v1/responses/{rid}")
    assert again.json()["status"] == "completed"
    assert passthrough(proxy, "/v1/responses/{id}", "200", at_least=polls + 2) == polls + 2
    assert generation_tokens(proxy) == OUTPUT
    assert requests(proxy) == 1
    lines = [json.loads(line) for line in log.getvalue().splitlines()]
    assert [line.get("kind") for line in lines] == [None, "background_tokens"]
    late = lines[1]
    assert (late["response_id"], late["counted_by"], late["output_tokens"]) == (
        rid,
        "retrieve",
        OUTPUT,
    )
    assert (late["finish_reason"], late["token_source"]) == ("stop", "usage")


def test_a_retrieval_of_a_response_the_proxy_did_not_start_counts_nothing(
    sim: Running, proxy: ProxyUnderTest
) -> None:
    """Started behind the proxy's back (another worker, another proxy): not counted."""
    rid = leave_after(sim.url, 4)
    whole = httpx.get(f"{proxy.url}/v1/responses/{rid}", params={"stream": "true"})
    assert '"type":"response.completed"' in whole.text
    assert passthrough(proxy, "/v1/responses/{id}", "200") == 1
    assert generation_tokens(proxy) == 0


def test_a_stream_read_to_its_end_then_again_counts_its_tokens_once(
    proxy: ProxyUnderTest,
) -> None:
    rid = read_whole(proxy.url)
    for query in ({"stream": "true"}, {"stream": "true", "starting_after": 3}):
        replay = httpx.get(f"{proxy.url}/v1/responses/{rid}", params=query)
        assert '"type":"response.completed"' in replay.text
    assert passthrough(proxy, "/v1/responses/{id}", "200", at_least=2) == 2
    (post,) = proxy.wait_records(1, exact=True)
    assert (post.endpoint, post.finish_reason, post.output_tokens) == (
        "/v1/responses",
        "stop",
        OUTPUT,
    )
    assert generation_tokens(proxy) == OUTPUT  # HEAD: 31 more for each GET


def requests(proxy: ProxyUnderTest) -> float:
    """Every measured request /metrics counted."""
    name = "tokenprobe_requests_total"
    return sum(s.value for m in proxy.registry.collect() for s in m.samples if s.name == name)


def generation_tokens(proxy: ProxyUnderTest) -> float:
    """Every output token /metrics counted, whatever its endpoint, model or source."""
    name = "tokenprobe_generation_tokens_total"
    return sum(s.value for m in proxy.registry.collect() for s in m.samples if s.name == name)


def test_a_background_streams_client_leaving_is_no_cancellation(proxy: ProxyUnderTest) -> None:
    """The POST's record: its TTFT (the model's own first token), no error, no finish yet
    (raw `in_progress`, as the acknowledgement not streamed is `queued`), and no tokens:
    a retrieval that sees the response finished counts them (above)."""
    rid = leave_after(proxy.url, 4)
    (m,) = proxy.wait_records(1)
    assert (m.endpoint, m.status_code, m.stream) == ("/v1/responses", 200, True)
    assert m.error_type is None, m.error_type
    assert (m.finish_reason, m.raw_finish_reason) == ("none", "in_progress")
    assert (m.output_tokens, m.token_source.value) == (None, "none")
    assert m.ttft is not None
    cancelled = {"model": MODEL, "endpoint": "/v1/responses", "code": "200"}
    assert proxy.sample("tokenprobe_requests_total", **cancelled, error_type="client_cancelled",
                        finish_reason="none") == 0  # fmt: skip
    httpx.get(f"{proxy.url}/v1/responses/{rid}", params={"stream": "true"})  # let it end


def test_a_background_stream_its_client_left_is_not_judged_met(
    sim: Running, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """It had not finished: the SLO leaves it out of attainment, as a client that left."""
    proxy = start_proxy(sim.url, slo="ttft=1,e2e=0.5,tpot=0.5")
    rid = leave_after(proxy.url, 4)
    proxy.wait_records(1, exact=True)
    labels = {"model": MODEL, "endpoint": "/v1/responses"}
    assert proxy.sample("tokenprobe_slo_requests_total", **labels, result="met") == 0
    assert proxy.sample("tokenprobe_slo_cancelled_requests_total", **labels) == 1
    httpx.get(f"{proxy.url}/v1/responses/{rid}", params={"stream": "true"})  # let it end


def passthrough(proxy: ProxyUnderTest, route: str, code: str, at_least: int = 1) -> float:
    """The passthrough count, once it is `at_least`: counted just after the last byte went
    out, so the proxy is given a moment (as tests/server/test_proxy_e2e.py does)."""
    name = "tokenprobe_passthrough_requests_total"
    deadline = time.monotonic() + 5
    while proxy.sample(name, route=route, code=code) < at_least and time.monotonic() < deadline:
        time.sleep(0.01)
    return proxy.sample(name, route=route, code=code)
