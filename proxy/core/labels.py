"""Bounded label values for things that come from clients or backends.

A model label may only take values the operator or the upstream vouched for: names from
`--model-allowlist`, or the ids the upstream lists at `/v1/models` (refreshed in the
background). Anything else becomes `other`, so a client sending random model names cannot
grow the number of series.
"""

from __future__ import annotations

import re

OTHER = "other"
#: Hard cap on distinct model labels, whatever the upstream lists.
MAX_MODELS = 200


class ModelLabels:
    def __init__(self, allowlist: tuple[str, ...] = ()) -> None:
        self._fixed = frozenset(allowlist[:MAX_MODELS])
        self._known: frozenset[str] = self._fixed

    def update_from_upstream(self, ids: list[str]) -> None:
        """Replace the upstream-listed models (the allowlist always stays)."""
        room = MAX_MODELS - len(self._fixed)
        self._known = self._fixed | frozenset(ids[: max(room, 0)])

    @property
    def known(self) -> frozenset[str]:
        return self._known

    def __call__(self, model: str) -> str:
        return model if model in self._known else OTHER


# Routes forwarded without measuring (OpenAI's and vLLM's); anything else collapses to a
# fixed label, so clients sending random paths cannot grow the number of series.
_ROUTES = (
    "/v1/models",
    "/v1/embeddings",
    "/v1/moderations",
    "/v1/rerank",
    "/v1/score",
    "/v1/tokenize",
    "/v1/detokenize",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/audio/speech",
    "/v1/images/generations",
    "/v1/files",
    "/v1/batches",
    # vLLM's routes outside /v1 (vllm-project/vllm: vllm/entrypoints/openai/api_server.py)
    "/tokenize",
    "/detokenize",
    "/health",
    "/ping",
    "/version",
    "/metrics",
    "/load",
    "/invocations",
    "/pooling",
    "/score",
    "/rerank",
    "/v2/rerank",
    "/classify",
    "/server_info",
    "/is_sleeping",
)
_ROUTE_SET = frozenset(_ROUTES)
_MODEL_ROUTE = re.compile(r"^/v1/models/.+$")  # ids may hold a slash (org/name)
#: The labels for paths that match no known route.
OTHER_V1 = "/v1/other"
OTHER_ROUTE = "/other"


def route_template(path: str) -> str:
    """A bounded route label for an unmeasured path."""
    if path in _ROUTE_SET:
        return path
    if _MODEL_ROUTE.match(path):
        return "/v1/models/{model}"
    for route in _ROUTES:
        if path.startswith(route + "/"):
            return route + "/{id}"
    return OTHER_V1 if path.startswith("/v1/") else OTHER_ROUTE
