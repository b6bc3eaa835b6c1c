"""The simulator's store of Responses, as vLLM 0.32 (run with
VLLM_ENABLE_RESPONSES_API_STORE=1) keeps it: every response whose request has `store`
true is stored when it ends, background or not, and a `previous_response_id` the store
does not hold is a 404 (vllm/entrypoints/openai/responses/serving.py:361-367, 927-932,
1185-1191)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from proxy.sim import SimApp, SimConfig, background
from tests.servers import ThreadedServer
from tests.sim.test_sim_support import running


@pytest.fixture(scope="module")
def sim() -> Iterator[tuple[ThreadedServer, SimApp]]:
    config = SimConfig(ttft=0.0, tokens_per_second=5000.0, output_tokens=3)
    with running(config) as pair:
        yield pair


@pytest.fixture
def client(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=10) as c:
        yield c


def respond(client: httpx.Client, **fields: Any) -> httpx.Response:
    return client.post("/v1/responses", json={"model": "sim-model", "input": "hi", **fields})


def final(reply: httpx.Response) -> dict[str, Any]:
    """The response object a POST answered: its body, or its stream's last event's."""
    if not reply.headers["content-type"].startswith("text/event-stream"):
        got: dict[str, Any] = reply.json()
        return got
    data = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    last = json.loads(data[-1])
    assert last["type"] == "response.completed"
    response: dict[str, Any] = last["response"]
    return response


@pytest.mark.parametrize("stream", [False, True])
def test_an_unknown_previous_response_id_is_vllms_404(client: httpx.Client, stream: bool) -> None:
    reply = respond(client, previous_response_id="resp_never_given", stream=stream)
    assert reply.status_code == 404
    assert reply.headers["content-type"] == "application/json"
    assert reply.json() == {
        "error": {
            "message": "Response with id 'resp_never_given' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }
    }


def test_a_background_request_after_an_unknown_id_is_refused_and_not_stored(
    client: httpx.Client,
) -> None:
    reply = respond(client, previous_response_id="resp_never_given", background=True)
    assert reply.status_code == 404
    assert reply.json()["error"]["message"] == "Response with id 'resp_never_given' not found."


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_answered_is_stored_continued_and_retrieved(
    client: httpx.Client, stream: bool
) -> None:
    """Streamed or not, the response is stored before it is answered: a later request
    continues it, and a retrieval answers the object the client got."""
    first = final(respond(client, stream=stream))
    assert first["status"] == "completed"
    second = respond(client, previous_response_id=first["id"], input="and then?")
    assert second.status_code == 200
    assert second.json()["previous_response_id"] == first["id"]
    retrieved = client.get(f"/v1/responses/{first['id']}")
    assert retrieved.status_code == 200
    assert retrieved.json() == first


def test_a_response_not_stored_is_not_continued(client: httpx.Client) -> None:
    """`store: false` (vLLM's `if request.store`: null too) stores nothing."""
    for store in (False, None, "false"):
        first = respond(client, store=store).json()
        again = respond(client, previous_response_id=first["id"])
        assert again.status_code == 404, store
        assert client.get(f"/v1/responses/{first['id']}").status_code == 404


@pytest.mark.parametrize(
    ("previous", "shown", "fields"),
    [
        (5, "5", {"stream": True}),
        (["resp_a"], "<list of 1 items>", {"background": True}),
        (5, "5", {"model": "no-such-model"}),  # pydantic refuses the body before any check
    ],
)
def test_a_previous_response_id_not_a_string_is_vllms_validation_400(
    client: httpx.Client, previous: Any, shown: str, fields: dict[str, Any]
) -> None:
    """ResponsesRequest's `previous_response_id: str | None` (responses/protocol.py): vLLM
    0.32's validation handler answers this body, checked by running it on the request."""
    reply = respond(client, previous_response_id=previous, **fields)
    assert reply.status_code == 400
    assert reply.headers["content-type"] == "application/json"
    loc = "body.previous_response_id"
    error = (
        f"{{'type': 'string_type', 'loc': '{loc}', 'msg': 'Input should be a valid string', "
        f"'input': '{shown}'}}"
    )
    assert reply.json() == {
        "error": {
            "message": f"1 validation error:\n  {error}",
            "type": "Bad Request",
            "param": loc,
            "code": 400,
        }
    }


def test_a_refused_request_is_refused_before_its_previous_id_is_looked_up(
    client: httpx.Client,
) -> None:
    """vLLM checks the model and the request first (serving.py:332-350), and stores no
    failed response: its id stays unknown."""
    reply = client.post(
        "/v1/responses",
        json={"model": "no-such-model", "input": "hi", "previous_response_id": "resp_never"},
    )
    assert reply.status_code == 404
    assert "no-such-model" in reply.json()["error"]["message"]


def test_the_store_forgets_the_oldest_ended_responses_past_its_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The store is bounded; a generation still running is never forgotten."""
    monkeypatch.setattr(background, "KEPT", 2)
    store = background.BackgroundStore()
    running_one = store.open("resp_running", {"id": "resp_running"}, streamed=True)
    for rid in ("resp_a", "resp_b", "resp_c"):
        store.keep({"id": rid})
    assert store.get("resp_running") is running_one
    assert [store.get(rid) is None for rid in ("resp_a", "resp_b", "resp_c")] == [
        True,
        True,
        False,
    ]
