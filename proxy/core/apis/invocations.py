"""SageMaker's `POST /invocations`, as vLLM 0.32 serves it: one route for every API, the
handler picked by the body.

vLLM (vllm/entrypoints/serve/sagemaker/api_router.py, `_attach_router`) validates the
body against each request type the served model supports, in order, and the first that
validates serves it: the generate types first (vllm/entrypoints/generate/factories.py,
`get_generate_invocation_types`: ChatCompletionRequest, then CompletionRequest), then the
pooling ones (vllm/entrypoints/pooling/factories.py, `get_pooling_invocation_types`:
EmbeddingRequest or ClassificationRequest, RerankRequest, ScoreRequest, PoolingRequest).
The answer is that handler's, streamed chat included. So a request is measured as the API
that serves it, and labelled as it (`endpoint`, as an alias of a path is labelled with
its API's canonical path); only a body no type takes keeps `/invocations`.

The proxy decides by cheap shape checks in vLLM's order, not by validating: a `messages`
list is chat (ChatCompletionRequest requires it), a `prompt` or `prompt_embeds` is text
completion (CompletionRequest refuses a body with neither, `validate_prompt_and_prompt_embeds`),
`query` with `documents` is rerank, the score shapes (`data_1`/`data_2`,
`queries`/`documents`, `queries`/`items`, `text_1`/`text_2`) are score, `input` is
embeddings, `data` is pooling. A pooling model serves a `messages` body as embeddings
(EmbeddingChatRequest): the proxy, which does not know the model's task, measures it as
chat; a classify model serves `input` as classify, measured as embeddings are. A
generative model refuses a body with neither `messages` nor `prompt` with completions' 400
(`validate_prompt_and_prompt_embeds` raises VLLMValidationError, no ValueError, so it
leaves pydantic and the loop: vllm/exceptions.py; seen from vLLM 0.32), which the proxy
counts under the API the body's fields name.
"""

from __future__ import annotations

from typing import Any, ClassVar

from proxy.core.apis.base import Api, RequestInfo
from proxy.core.apis.chat import Chat
from proxy.core.apis.completions import Completions
from proxy.core.apis.pooling import Embeddings, Pooling, Rerank, Score

_CHAT, _COMPLETIONS = Chat(), Completions()
_EMBEDDINGS, _RERANK, _SCORE, _POOLING = Embeddings(), Rerank(), Score(), Pooling()
#: ScoreRequest's shapes (vllm/entrypoints/pooling/scoring/protocol.py): the pairs of fields
#: each of its request types requires.
_SCORE_PAIRS = (("data_1", "data_2"), ("queries", "documents"), ("queries", "items"),
                ("text_1", "text_2"))  # fmt: skip


def served_by(obj: dict[str, Any]) -> Api | None:
    """The Api whose handler vLLM serves this `/invocations` body with, None when no
    request type takes it (vLLM answers 400, "Cannot find suitable handler")."""
    if type(obj.get("messages")) is list:
        return _CHAT
    if "prompt" in obj or "prompt_embeds" in obj:
        return _COMPLETIONS
    if "query" in obj and "documents" in obj:
        return _RERANK
    if any(a in obj and b in obj for a, b in _SCORE_PAIRS):
        return _SCORE
    if "input" in obj:
        return _EMBEDDINGS
    if "data" in obj:
        return _POOLING
    return None


class Invocations(Api):
    """Reads the request as the Api that serves it; its RequestInfo names that Api, so the
    answer is measured by it. Only a body no Api takes stays with this one, and its
    answer (vLLM's 400) is counted as an error of `/invocations`."""

    endpoint = "/invocations"
    paths = ("/invocations",)
    #: Only a body no API takes is measured as this one: it is refused, nothing generated.
    generative: ClassVar[bool] = False
    operation = "chat"
    #: The proxy may ask for usage for a chat or completions stream here, as there.
    usage_reshapes = Chat.usage_reshapes | Completions.usage_reshapes
    measures = (
        "as the API vLLM serves the body with (chat for a messages list, completions for "
        "a prompt, then rerank, score, embeddings, pooling by their fields), labelled with "
        "that API's endpoint; a body none takes: its error, as /invocations"
    )

    def read_request(self, obj: dict[str, Any]) -> RequestInfo:
        api = served_by(obj)
        return super().read_request(obj) if api is None else api.read_request(obj)

    def ask_for_usage(self, obj: dict[str, Any], body: bytes) -> bytes | None:
        api = served_by(obj)
        return None if api is None else api.ask_for_usage(obj, body)
