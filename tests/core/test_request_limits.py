"""The output limit a request is logged with (`max_tokens` on the record, OTLP's
`gen_ai.request.max_tokens`): the one vLLM 0.32 applies, read as each route's own request
class reads it.

- Chat (and batch chat): `max_completion_tokens`, unless absent or null, else `max_tokens`
  (chat_completion/protocol.py build_tok_params; serving.py and batch_serving.py pass
  `max_completion_tokens if ... is not None else max_tokens` to get_max_tokens).
- Completions: `max_tokens` alone; CompletionRequest has no `max_completion_tokens`
  (completion/protocol.py) and vLLM ignores a field it does not have.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest

from proxy.core.apis import api_for
from proxy.core.observe import StreamObserver
from proxy.core.request import CHAT, COMPLETIONS, parse_request

BATCH_CHAT = "/v1/chat/completions/batch"
MESSAGES = [{"role": "user", "content": "Hi"}]
FIRST = {CHAT: {"messages": MESSAGES}, BATCH_CHAT: {"messages": [MESSAGES]},
         COMPLETIONS: {"prompt": "Hi"}}  # fmt: skip


def limit(endpoint: str, **fields: object) -> int | None:
    info, _ = parse_request(endpoint, orjson.dumps({"model": "m", **FIRST[endpoint], **fields}))
    return info.max_tokens


@pytest.mark.parametrize("endpoint", [CHAT, BATCH_CHAT])
@pytest.mark.parametrize(
    ("fields", "applied"),
    [
        ({"max_tokens": 5, "max_completion_tokens": None}, 5),  # null is no limit of its own
        ({"max_completion_tokens": None, "max_tokens": 5}, 5),
        ({"max_tokens": 5, "max_completion_tokens": 9}, 9),
        ({"max_completion_tokens": 9}, 9),
        ({"max_tokens": 5}, 5),
        ({"max_tokens": None, "max_completion_tokens": None}, None),
        ({"max_tokens": 5, "max_completion_tokens": "9"}, 9),  # pydantic's lax int
    ],
)
def test_chat_logs_the_limit_vllm_applies(
    endpoint: str, fields: dict[str, object], applied: int | None
) -> None:
    assert limit(endpoint, **fields) == applied


@pytest.mark.parametrize(
    ("fields", "applied"),
    [
        ({"max_tokens": 5, "max_completion_tokens": 9}, 5),  # no field of completions'
        ({"max_completion_tokens": 9}, None),
        ({"max_tokens": 5, "max_completion_tokens": None}, 5),
        ({"max_tokens": "5"}, 5),
    ],
)
def test_completions_log_max_tokens_alone(fields: dict[str, object], applied: int | None) -> None:
    assert limit(COMPLETIONS, **fields) == applied


def test_the_record_carries_the_limit_applied() -> None:
    """The record's `max_tokens` is the request's, whatever the stream said."""
    for endpoint, fields, applied in (
        (CHAT, {"max_tokens": 5, "max_completion_tokens": None}, 5),
        (COMPLETIONS, {"max_tokens": 5, "max_completion_tokens": 9}, 5),
    ):
        api = api_for(endpoint)
        assert api is not None
        request = {"model": "m", **FIRST[endpoint], "stream": True, **fields}
        observer = StreamObserver(api.read_request(request), 0.0)
        observer.open(200, "text/event-stream", 0.0)
        observer.feed(b"data: [DONE]\n\n", 0.125)
        finished = observer.finish(
            end=0.25, started_at=0.0, status_code=200, error_type=None, error_message=None
        )
        assert asyncio.run(finished).max_tokens == applied, endpoint
