"""vLLM 0.32's label reads and a Response's cancel, through the proxy in front of the simulator.

`/generative_scoring` and `/v1/systemone` run the engine for one token per read and answer
one JSON body with usage (vllm/entrypoints/generate/generative_scoring/serving.py:314-353,
structured_decisions/serving.py:130-136): measured, as their neighbours are.
`POST /v1/responses/{id}/cancel` (openai/responses/api_router.py) stops a background
response: counted under a route of its own, not with the GET that retrieves one.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from tests.conftest import MODEL, ProxyUnderTest

READS: Any = [
    (
        "/generative_scoring",
        {"query": "Is this good?", "items": ["yes it is", "no", "maybe"], "label_token_ids": [1]},
        ("prompt_tokens", "completion_tokens"),
        3,
    ),
    (
        "/v1/systemone",
        {"state": "The sky is blue", "questions": {"q1": {"type": "noul"}, "q2": {"type": "noul"}}},
        ("input_tokens", "output_tokens"),
        2,
    ),
]


@pytest.mark.parametrize(("path", "body", "names", "reads"), READS)
def test_a_label_read_is_measured_with_its_usage(
    proxy: ProxyUnderTest, path: str, body: dict[str, Any], names: tuple[str, str], reads: int
) -> None:
    reply = httpx.post(proxy.url + path, json={"model": MODEL, **body})
    assert reply.status_code == 200
    usage = reply.json()["usage"]
    (m,) = proxy.wait_records(1, exact=True)
    assert (m.endpoint, m.ok, m.stream, m.model) == (path, True, False, MODEL)
    # one output token per read (vLLM's max_tokens=1), every read's prompt together
    assert (m.prompt_tokens, m.output_tokens) == (usage[names[0]], usage[names[1]])
    assert m.output_tokens == reads and m.token_source.value == "usage"
    assert proxy.sample("tokenprobe_passthrough_requests_total", route=path, code="200") == 0
    labels = {"model": MODEL, "endpoint": path, "code": "200", "error_type": "none"}
    assert proxy.sample("tokenprobe_requests_total", **labels, finish_reason="none") == 1


def test_a_label_read_that_vllm_refuses_is_counted_with_its_error(proxy: ProxyUnderTest) -> None:
    body = {"model": MODEL, "query": "q", "items": [], "label_token_ids": [1]}
    reply = httpx.post(proxy.url + "/generative_scoring", json=body)
    assert reply.status_code == 400
    (m,) = proxy.wait_records(1, exact=True)
    assert (m.endpoint, m.error_type.value if m.error_type else None) == (
        "/generative_scoring",
        "bad_request",
    )


def test_a_responses_cancel_has_its_own_route_label(proxy: ProxyUnderTest) -> None:
    cancel = httpx.post(proxy.url + "/v1/responses/resp_0123/cancel")
    retrieve = httpx.get(proxy.url + "/v1/responses/resp_0123")
    assert cancel.status_code == retrieve.status_code == 404  # the simulator has no such id
    assert passthrough(proxy, "/v1/responses/{id}/cancel", "404") == 1
    assert passthrough(proxy, "/v1/responses/{id}", "404") == 1


def passthrough(proxy: ProxyUnderTest, route: str, code: str) -> float:
    """The passthrough count, once there is one: counted just after the last byte went
    out, so the proxy is given a moment (as tests/server/test_proxy_e2e.py does)."""
    name = "tokenprobe_passthrough_requests_total"
    deadline = time.monotonic() + 5
    while not proxy.sample(name, route=route, code=code) and time.monotonic() < deadline:
        time.sleep(0.01)
    return proxy.sample(name, route=route, code=code)
