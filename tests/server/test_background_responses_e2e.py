"""Background Responses through the proxy in front of the simulator.

vLLM 0.32 generates a `background: true` stream in a task of its own, so a client that
leaves the POST's stream stops only its reading; `GET /v1/responses/{id}?stream=true
&starting_after=N` reads the rest, up to `response.completed` with the whole usage
(vllm/entrypoints/openai/responses/serving.py:537-589, 1070-1131; api_router.py:82-109).
The GET is measured as a Responses stream under `/v1/responses/{id}`; the POST whose
client left is no cancellation: no error, no finish yet, no tokens (the GET counts them).
"""

from __future__ import annotations

import json
import re
import socket
import time
from urllib.parse import urlsplit

import httpx

from proxy.server.admission import measured_api
from tests.conftest import MODEL, ProxyUnderTest
from tests.server.conftest import no_proxy

PROGRAM = b"x-sim-output-tokens: 30\r\nx-sim-tps: 60\r\n"
OUTPUT = 31  # the 30 programmed and the EOS, as vLLM's usage counts them


def leave_after(url: str, events: int) -> str:
    """POST a background stream, read `events` events, leave; the response's id."""
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
        while got.count(b"data: ") < events:
            got += s.recv(65536)
    found = re.search(rb'"id":"(resp_[^"]+)"', got)
    assert found is not None
    return found.group(1).decode()


def test_a_resumed_background_stream_is_measured_as_a_responses_stream(
    proxy: ProxyUnderTest,
) -> None:
    rid = leave_after(proxy.url, 4)
    post = proxy.wait_records(1)[0]
    resumed = httpx.get(
        f"{proxy.url}/v1/responses/{rid}", params={"stream": "true", "starting_after": 3}
    )
    assert resumed.status_code == 200 and '"type":"response.completed"' in resumed.text
    records = proxy.wait_records(2, exact=True)
    assert records[0] is post
    m = records[1]
    assert (m.endpoint, m.ok, m.stream, m.response_id) == ("/v1/responses/{id}", True, True, rid)
    assert (m.finish_reason, m.raw_finish_reason) == ("stop", "completed")
    assert (m.output_tokens, m.token_source.value) == (OUTPUT, "usage")
    assert m.prompt_tokens is not None and m.ttft is not None and m.content_events > 0
    name = "tokenprobe_passthrough_requests_total"
    assert proxy.sample(name, route="/v1/responses/{id}", code="200") == 0


def test_a_background_streams_client_leaving_is_no_cancellation(proxy: ProxyUnderTest) -> None:
    """The POST's record: its TTFT (the model's own first token), no error, no finish yet
    (raw `in_progress`, as the acknowledgement not streamed is `queued`), and no tokens,
    which the GET that reads the rest counts whole (here they would be counted twice)."""
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


def test_a_plain_retrieval_stays_a_passthrough(proxy: ProxyUnderTest) -> None:
    rid = leave_after(proxy.url, 2)
    httpx.get(f"{proxy.url}/v1/responses/{rid}", params={"stream": "true"})  # to its end
    whole = httpx.get(f"{proxy.url}/v1/responses/{rid}")
    assert whole.status_code == 200 and whole.json()["status"] == "completed"
    assert passthrough(proxy, "/v1/responses/{id}", "200") == 1  # the plain GET alone


def passthrough(proxy: ProxyUnderTest, route: str, code: str) -> float:
    """The passthrough count, once there is one: counted just after the last byte went
    out, so the proxy is given a moment (as tests/server/test_proxy_e2e.py does)."""
    name = "tokenprobe_passthrough_requests_total"
    deadline = time.monotonic() + 5
    while not proxy.sample(name, route=route, code=code) and time.monotonic() < deadline:
        time.sleep(0.01)
    return proxy.sample(name, route=route, code=code)


@no_proxy
def test_the_relay_measures_a_get_only_as_a_stream_read_again() -> None:
    assert measured_api("GET", "/v1/responses/resp_1", "stream=true") is not None
    assert measured_api("GET", "/v1/responses/resp_1", "") is None
    assert measured_api("POST", "/v1/responses/resp_1", "stream=true") is None
    assert measured_api("DELETE", "/v1/responses/resp_1", "stream=true") is None
