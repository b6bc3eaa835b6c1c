"""The per-API seams and their registry: adding an API is one module and one line here.

`api_for(path)` answers for a normalised request path (no query); the relay measures a
POST whose path has an Api and forwards everything else unmeasured (every GET too: a
background Response's stream read again, `GET /v1/responses/{id}?stream=true`, replays
stored events with the whole usage to every reader, so measuring it would count the
response again on each read). `ENDPOINTS` is the
closed set of `endpoint` label values (each Api's canonical path).
"""

from __future__ import annotations

from proxy.core.apis.audio import Transcriptions, Translations
from proxy.core.apis.base import (
    FINISH_LABELS,
    Api,
    ErrorShape,
    Facts,
    RequestInfo,
    TokenCounts,
)
from proxy.core.apis.batch_chat import BatchChat
from proxy.core.apis.chat import WITHOUT_V1, Chat
from proxy.core.apis.cohere import CohereChat
from proxy.core.apis.completions import Completions
from proxy.core.apis.generate import Generate
from proxy.core.apis.invocations import Invocations
from proxy.core.apis.label_reads import GenerativeScoring, StructuredDecisions
from proxy.core.apis.llamacpp import LlamaCompletion
from proxy.core.apis.messages import Messages
from proxy.core.apis.ollama import OllamaChat, OllamaEmbed, OllamaGenerate
from proxy.core.apis.pooling import (
    RERANKING,
    Classify,
    CohereEmbed,
    Embeddings,
    Pooling,
    Rerank,
    Score,
)
from proxy.core.apis.responses import Responses

#: Every measured API, one line each.
APIS: tuple[Api, ...] = (
    Chat(),
    Completions(),
    Messages(),
    Responses(),
    Embeddings(),
    Pooling(),
    Score(),
    Rerank(),
    Classify(),
    Generate(),
    Transcriptions(),
    Translations(),
    CohereChat(),
    CohereEmbed(),
    OllamaChat(),
    OllamaGenerate(),
    OllamaEmbed(),
    LlamaCompletion(),
    BatchChat(),
    Invocations(),
    GenerativeScoring(),
    StructuredDecisions(),
)

_BY_PATH = {path: api for api in APIS for path in api.paths}
#: The paths only llama-server serves (tools/server/server.cpp): its native completion
#: (`/completion`, and `/completions`, the same handler), OpenAI's chat without the /v1,
#: and its rerank's `/reranking` names. In front of another backend they are a client's wrong path (vLLM 0.32 answers
#: them 404), which measured would count in chat's error rate and SLO: the relay measures
#: them only where the backend may be llama-server (proxy/server/admission.py
#: `measured_api`).
LLAMACPP_PATHS = frozenset({WITHOUT_V1, *LlamaCompletion.paths, *RERANKING})
_BY_ENDPOINT = {api.endpoint: api for api in APIS}
#: The closed set of `endpoint` label values.
ENDPOINTS = frozenset(_BY_ENDPOINT)


def api_for(path: str) -> Api | None:
    """The Api serving this normalised path, or None (forwarded unmeasured)."""
    return _BY_PATH.get(path)


def api_under(path: str) -> Api | None:
    """The Api serving this path or a path above it (/v1/messages for
    /v1/messages/count_tokens): whose clients a request to it comes from."""
    while path:
        api = _BY_PATH.get(path)
        if api is not None:
            return api
        path = path.rpartition("/")[0]
    return None


def api_of(endpoint: str) -> Api:
    """The Api behind an endpoint label (RequestInfo.endpoint, Measurement.endpoint)."""
    return _BY_ENDPOINT[endpoint]


__all__ = [
    "APIS",
    "ENDPOINTS",
    "FINISH_LABELS",
    "LLAMACPP_PATHS",
    "Api",
    "ErrorShape",
    "Facts",
    "RequestInfo",
    "TokenCounts",
    "api_for",
    "api_of",
    "api_under",
]
