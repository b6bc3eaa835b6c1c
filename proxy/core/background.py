"""Background Responses whose tokens their POST's answer did not count, and the GET that
counts them later. Sans I/O: the server holds one table per process
(proxy/server/exchange.py `Context.background`) and hands it to each exchange.

vLLM 0.32 (vllm/entrypoints/openai/responses/): a `background: true` request generates in
a task of its own (serving.py:537-589). Not streamed, the POST answers at once with the
response `queued` and no usage; streamed, its client may leave and the generation goes on
(api_router.py `with_cancellation` cancels only the reader). Either way the POST's answer
ends before the response does, so its record has no tokens. The response is stored:
`GET /v1/responses/{id}` answers the stored object, `queued` until
`responses_full_generator` stores the final one with its status and usage
(serving.py:928-932; a failure is stored `failed` without usage, 1087-1102; a cancel
`cancelled`, never overwritten, 1156-1183), and `?stream=true&starting_after=N` replays a
streamed response's events from N + 1 to `response.completed` with the whole usage
(serving.py:1104-1131).

So the first retrieval the proxy sees answered 2xx with a terminal status (`settled`)
adds the response's usage to the token counters (`LateTokens`, proxy/sinks/dispatch.py
`Sinks.late_tokens`), and the id is forgotten: a second retrieval counts nothing. Only an
id whose POST went through this process is counted (`Table`): another worker's, another
proxy's, or one whose POST already counted its tokens never is.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Generic, TypeVar
from urllib.parse import parse_qsl

from proxy.core.measurement import NONE_LABEL, Measurement, TokenSource
from proxy.core.request import RequestInfo

#: Background Responses one process remembers while their tokens are not counted: each
#: an id, its POST's labels and a RequestInfo without its prompt (`Table.add`).
LIMIT = 4096
#: A stored Response's route, `GET /v1/responses/{response_id}` (vLLM's api_router.py).
_RETRIEVE = "/v1/responses/"
#: pydantic's words for a query's true (FastAPI reads `stream: bool | None` with them).
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})

L = TypeVar("L")


class Table(Generic[L]):
    """The background Responses this process started whose tokens no answer counted yet,
    by response id: each its POST's RequestInfo and labels (`L`: the sinks' Labels, the
    key and attribution labels as the POST had them). At most `limit` ids, the oldest
    forgotten first (its tokens then never counted): memory stays bounded whatever the
    clients never retrieve."""

    __slots__ = ("_by_id", "limit")

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self._by_id: OrderedDict[str, tuple[RequestInfo, L]] = OrderedDict()

    def add(self, response_id: str, info: RequestInfo, labels: L) -> None:
        # the prompt and what was read from it stay with the POST: counts come from usage
        slim = replace(info, prompt=None, digests=None, template=None, system=None, echoed=())
        by_id = self._by_id
        by_id[response_id] = slim, labels
        by_id.move_to_end(response_id)
        while len(by_id) > self.limit:
            by_id.popitem(last=False)

    def get(self, response_id: str) -> tuple[RequestInfo, L] | None:
        return self._by_id.get(response_id)

    def take(self, response_id: str) -> tuple[RequestInfo, L] | None:
        """The entry, once: for the retrieval that counts the response."""
        return self._by_id.pop(response_id, None)

    def __len__(self) -> int:
        return len(self._by_id)


def retrieved_id(path: str) -> str | None:
    """The response id of `/v1/responses/{response_id}`, None for any other path."""
    if not path.startswith(_RETRIEVE):
        return None
    rid = path[len(_RETRIEVE) :]
    return rid if rid and "/" not in rid else None


def retrieval(table: Table[L], path: str, query: str) -> tuple[RequestInfo, str] | None:
    """A GET of a background Response in `table`: its POST's RequestInfo (streamed as the
    query's `stream` says: vLLM's api_router.py retrieve_responses reads `stream` and
    `starting_after` from the query) and its id. None for any other GET."""
    rid = retrieved_id(path)
    found = None if rid is None else table.get(rid)
    if rid is None or found is None:
        return None
    stream = False
    for name, value in parse_qsl(query):
        if name == "stream":
            stream = value.lower() in _TRUE
    return replace(found[0], stream=stream), rid


def left_unfinished(info: RequestInfo, m: Measurement) -> bool:
    """A background POST's answer that ended before its response did, its tokens not
    counted: the acknowledgement not streamed (`queued`) or a stream its client left
    (`in_progress`, proxy/core/observe.py), answered 2xx with the response's id."""
    return (
        info.detached
        and m.response_id is not None
        and 200 <= m.status_code < 300
        and m.error_type is None
        and m.finish_reason == NONE_LABEL
        and m.output_tokens is None
    )


def settled(m: Measurement) -> bool:
    """A retrieval answered 2xx with the response finished: a terminal status
    (completed, incomplete, failed, cancelled; `queued` and `in_progress` map to no
    finish). Its usage, when it has one, is all the response generated."""
    return 200 <= m.status_code < 300 and m.finish_reason != NONE_LABEL


@dataclass(frozen=True, slots=True)
class LateTokens:
    """A background Response's tokens, counted when a retrieval first saw it finished
    (`settled`): the token counters only, with its POST's labels; no request, latency,
    SLO verdict, span or conversation turn (the POST had its record)."""

    response_id: str
    endpoint: str
    model: str  # as the POST asked for it
    response_model: str | None
    started_at: float  # the retrieval's arrival, wall clock
    prompt_tokens: int | None
    output_tokens: int | None
    cached_prompt_tokens: int | None
    cache_write_tokens: int | None  # written to the prefix cache (Measurement's, as it says)
    token_source: TokenSource
    reasoning_tokens: int | None
    reasoning_token_source: str | None
    finish_reason: str  # the closed-set label
    raw_finish_reason: str | None
    #: which answer counted them: "retrieve" (the stored object) or "retrieve_stream"
    #: (its events replayed, `?stream=true`)
    counted_by: str


def late_tokens(m: Measurement, response_id: str) -> LateTokens | None:
    """The tokens of a settled retrieval's record; None without usage (vLLM stores a
    failed or cancelled response without any: nothing to count)."""
    if m.token_source is not TokenSource.USAGE or m.output_tokens is None:
        return None
    return LateTokens(
        response_id=response_id,
        endpoint=m.endpoint,
        model=m.model,
        response_model=m.response_model,
        started_at=m.started_at,
        prompt_tokens=m.prompt_tokens,
        output_tokens=m.output_tokens,
        cached_prompt_tokens=m.cached_prompt_tokens,
        cache_write_tokens=m.cache_write_tokens,
        token_source=m.token_source,
        reasoning_tokens=m.reasoning_tokens,
        reasoning_token_source=m.reasoning_token_source,
        finish_reason=m.finish_reason,
        raw_finish_reason=m.raw_finish_reason,
        counted_by="retrieve_stream" if m.stream else "retrieve",
    )
