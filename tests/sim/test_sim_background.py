"""Background Responses from the simulator, as vLLM 0.32 runs them: the generation of a
`background: true` stream goes on when its client leaves, and `GET /v1/responses/{id}`
`?stream=true&starting_after=N` reads its events from N + 1 to `response.completed`
(vllm/entrypoints/openai/responses/serving.py:537-589, 1070-1131)."""

from __future__ import annotations

import json
import re
import socket
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
    rid = leave_after(url, 2)
    httpx.get(f"{url}/v1/responses/{rid}", params={"stream": "1"})  # to its end
    whole = httpx.get(f"{url}/v1/responses/{rid}")
    assert whole.status_code == 200
    assert (whole.json()["id"], whole.json()["status"]) == (rid, "completed")


def test_an_unknown_response_is_vllms_404(url: str) -> None:
    reply = httpx.get(f"{url}/v1/responses/resp_nope", params={"stream": "true"})
    assert reply.status_code == 404
    assert reply.json()["error"]["message"] == "Response with id 'resp_nope' not found."
