"""An action on one item of a route is a route label of its own: vLLM 0.32's
`POST /v1/responses/{response_id}/cancel` (openai/responses/api_router.py) is not counted
with the GET that retrieves the response."""

from __future__ import annotations

import pytest

from proxy.core.labels import route_template


@pytest.mark.parametrize(
    ("path", "want"),
    [
        ("/v1/responses/resp_9/cancel", "/v1/responses/{id}/cancel"),
        ("/v1/responses/resp_9", "/v1/responses/{id}"),
        ("/v1/responses/resp_9/cancel/more", "/v1/responses/{id}"),
        ("/v1/responses/resp_9/other", "/v1/responses/{id}"),
        ("/v1/batches/batch_1/cancel", "/v1/batches/{id}"),  # no such action of vLLM's
    ],
)
def test_an_items_action_has_its_own_route(path: str, want: str) -> None:
    assert route_template(path) == want
