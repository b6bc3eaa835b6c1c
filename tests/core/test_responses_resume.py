"""Which GET the proxy measures: only `GET /v1/responses/{id}` with `stream` true, as vLLM's
retrieve_responses reads it (openai/responses/api_router.py:82-109: `stream: bool | None`
and `starting_after: int | None` query parameters, `{response_id}` one path segment)."""

from __future__ import annotations

import pytest

from proxy.core.apis import api_for, api_for_get, api_of
from proxy.core.apis.responses_resume import ResponsesResume

RESUME = "/v1/responses/{id}"


@pytest.mark.parametrize(
    "query",
    ["stream=true", "stream=True", "stream=1", "stream=yes", "starting_after=3&stream=on",
     "stream=false&stream=true"],
)  # fmt: skip
def test_a_stream_read_again_is_measured(query: str) -> None:
    api = api_for_get("/v1/responses/resp_1a2b", query)
    assert api is not None and api.endpoint == RESUME


@pytest.mark.parametrize(
    ("path", "query"),
    [
        ("/v1/responses/resp_1", ""),  # the stored response object: no generation
        ("/v1/responses/resp_1", "stream=false"),
        ("/v1/responses/resp_1", "stream=maybe"),  # vLLM's 422
        ("/v1/responses/resp_1", "stream=true&stream=0"),  # the last one counts
        ("/v1/responses/resp_1", "streams=true"),
        ("/v1/responses", "stream=true"),
        ("/v1/responses/", "stream=true"),
        ("/v1/responses/resp_1/cancel", "stream=true"),
        ("/v1/chat/completions/x", "stream=true"),
    ],
)
def test_other_gets_are_forwarded_unmeasured(path: str, query: str) -> None:
    assert api_for_get(path, query) is None


def test_the_route_of_items_is_no_posts_path() -> None:
    assert api_for(RESUME) is None
    assert api_for_get("/v1/responses/r", "stream=true") is api_of(RESUME)


def test_a_resume_is_read_as_a_stream_with_no_model_or_prompt() -> None:
    api = ResponsesResume()
    obj = api.decode(b"", b"")
    assert obj == {}
    info = api.read_request({})
    assert (info.endpoint, info.stream, info.model, info.prompt) == (RESUME, True, "", None)
