"""Background Responses through the proxy in front of the simulator.

vLLM 0.32 generates a `background: true` stream in a task of its own, so a client that
leaves the POST's stream stops only its reading; `GET /v1/responses/{id}?stream=true
&starting_after=N` reads the stored events again, up to `response.completed` with the
whole usage, the same for every reader (vllm/entrypoints/openai/responses/serving.py
:537-589, 1070-1131; api_router.py:82-109). So the GET is forwarded unmeasured (the proxy
cannot know which reader counted the response already), and a background response's
tokens are counted once at most: by its POST read to its end. The POST whose client left
is no cancellation: no error, no finish yet, no tokens, and no SLO verdict of met.
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import httpx

from tests.conftest import MODEL, ProxyUnderTest, Running

PROGRAM = b"x-sim-output-tokens: 30\r\nx-sim-tps: 60\r\n"
OUTPUT = 31  # the 30 programmed and the EOS, as vLLM's usage counts them
HEADERS = {"x-sim-output-tokens": "30", "x-sim-tps": "60"}  # PROGRAM, for httpx


def leave_after(url: str, events: int) -> str:
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


def test_a_resumed_stream_is_a_passthrough_that_counts_no_tokens(proxy: ProxyUnderTest) -> None:
    """Read again whole, read again from an event on, and left by its reader: each GET is
    forwarded unmeasured and counted by route, as the plain retrieval is; the POST whose
    client left keeps the only record."""
    rid = leave_after(proxy.url, 4)
    with httpx.stream("GET", f"{proxy.url}/v1/responses/{rid}", params={"stream": "true"}) as r:
        for line in r.iter_lines():
            if '"response.output_text.delta"' in line:
                break  # its reader leaves: nothing to cancel, nothing to record
    replay = httpx.get(f"{proxy.url}/v1/responses/{rid}", params={"stream": "true"})
    assert replay.status_code == 200 and '"type":"response.completed"' in replay.text
    after = httpx.get(
        f"{proxy.url}/v1/responses/{rid}", params={"stream": "1", "starting_after": 3}
    )
    assert '"type":"response.completed"' in after.text
    whole = httpx.get(f"{proxy.url}/v1/responses/{rid}")
    assert whole.status_code == 200 and whole.json()["status"] == "completed"
    assert passthrough(proxy, "/v1/responses/{id}", "200", at_least=3) >= 3
    (post,) = proxy.wait_records(1, exact=True)
    assert (post.endpoint, post.output_tokens) == ("/v1/responses", None)


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


def generation_tokens(proxy: ProxyUnderTest) -> float:
    """Every output token /metrics counted, whatever its endpoint, model or source."""
    name = "tokenprobe_generation_tokens_total"
    return sum(s.value for m in proxy.registry.collect() for s in m.samples if s.name == name)


def test_a_background_streams_client_leaving_is_no_cancellation(proxy: ProxyUnderTest) -> None:
    """The POST's record: its TTFT (the model's own first token), no error, no finish yet
    (raw `in_progress`, as the acknowledgement not streamed is `queued`), and no tokens:
    nothing counts them (a GET that reads the rest is a passthrough)."""
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
