"""Background Responses from the simulator, as vLLM 0.32 runs them: the generation of a
`background: true` stream goes on when its client leaves, and `GET /v1/responses/{id}`
`?stream=true&starting_after=N` reads its events from N + 1 to `response.completed`
(vllm/entrypoints/openai/responses/serving.py:537-589, 1070-1131)."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from proxy.sim import SimApp, SimConfig
from tests.servers import ThreadedServer
from tests.sim.test_sim_support import running

OUTPUT = 20  # programmed tokens; the usage adds the EOS


@pytest.fixture(scope="module")
def sim() -> Iterator[tuple[ThreadedServer, SimApp]]:
    config = SimConfig(ttft=0.0, tokens_per_second=100.0, output_tokens=OUTPUT)
    with running(config) as pair:
        yield pair


def leave_after(url: str, events: int) -> str:
    """POST a background stream, read `events` events, leave; the response's id."""
    body = json.dumps(
        {"model": "sim-model", "input": "hi", "background": True, "stream": True}
    ).encode()
    where = urlsplit(url)
    with socket.create_connection((where.hostname, where.port)) as s:
        s.sendall(
            b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        got = b""
        while got.count(b"data: ") < events:
            got += s.recv(65536)
    found = re.search(rb'"id":"(resp_[^"]+)"', got)
    assert found is not None
    return found.group(1).decode()


def events(text: str) -> list[dict[str, object]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def test_a_background_stream_generates_on_and_is_read_again_after_an_event(url: str) -> None:
    rid = leave_after(url, 3)
    resumed = httpx.get(f"{url}/v1/responses/{rid}", params={"stream": "true", "starting_after": 2})
    assert resumed.status_code == 200
    assert resumed.headers["content-type"].startswith("text/event-stream")
    got = events(resumed.text)
    assert got[0]["sequence_number"] == 3  # starting_after + 1
    numbers = [e["sequence_number"] for e in got]
    assert numbers == list(range(3, 3 + len(numbers)))
    last = got[-1]
    assert last["type"] == "response.completed"
    response = last["response"]
    assert isinstance(response, dict) and response["id"] == rid
    assert response["usage"]["output_tokens"] == OUTPUT + 1  # all of it, though its client left


def test_a_background_response_is_retrieved_whole_without_stream(url: str) -> None:
    """The stored object: `queued` (no usage) while it generates, though its stream said
    `in_progress`, then the final one (serving.py:537-549, 928-932)."""
    rid = leave_after(url, 2)
    early = httpx.get(f"{url}/v1/responses/{rid}").json()
    assert (early["id"], early["status"], early["usage"]) == (rid, "queued", None)
    httpx.get(f"{url}/v1/responses/{rid}", params={"stream": "1"})  # to its end
    whole = httpx.get(f"{url}/v1/responses/{rid}")
    assert whole.status_code == 200
    assert (whole.json()["id"], whole.json()["status"]) == (rid, "completed")
    assert whole.json()["usage"]["output_tokens"] == OUTPUT + 1


def post_not_streamed(url: str) -> dict[str, object]:
    body = {"model": "sim-model", "input": "hi", "background": True}
    answer = httpx.post(f"{url}/v1/responses", json=body)
    assert answer.status_code == 200
    got: dict[str, object] = answer.json()
    return got


def test_a_background_response_not_streamed_is_answered_queued_then_stored_final(
    url: str,
) -> None:
    """vLLM answers at once with the response queued, no output, no usage; the
    generation stores the final response, which a retrieval then answers."""
    started = time.monotonic()
    queued = post_not_streamed(url)
    assert time.monotonic() - started < (OUTPUT / 100) * 0.8  # before its generation's time
    assert (queued["status"], queued["usage"], queued["output"]) == ("queued", None, [])
    assert queued["background"] is True
    rid = queued["id"]
    assert httpx.get(f"{url}/v1/responses/{rid}").json()["status"] == "queued"
    deadline = time.monotonic() + 5
    while (got := httpx.get(f"{url}/v1/responses/{rid}").json())["status"] == "queued":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert (got["id"], got["status"]) == (rid, "completed")
    assert isinstance(got["usage"], dict) and got["usage"]["output_tokens"] == OUTPUT + 1


def test_the_events_of_a_response_not_streamed_are_a_dropped_stream(url: str) -> None:
    """No event deque: vLLM's reader raises after its 200 went out (serving.py:1109-1115),
    and the connection drops with no body."""
    rid = post_not_streamed(url)["id"]
    with httpx.stream("GET", f"{url}/v1/responses/{rid}", params={"stream": "true"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        with pytest.raises(httpx.RemoteProtocolError):
            r.read()


def test_an_unknown_response_is_vllms_404(url: str) -> None:
    reply = httpx.get(f"{url}/v1/responses/resp_nope", params={"stream": "true"})
    assert reply.status_code == 404
    assert reply.json()["error"]["message"] == "Response with id 'resp_nope' not found."
