"""A token-id prompt is kept as the number of its ids (proxy/core/request.py TokenIds).

A request keeps its RequestInfo until it ends, which a backend's queue may hold off for
--first-byte-timeout; decoded, an id is a pointer and an int object (about 40 bytes, 8
times its JSON), so four clients' 25 MB bodies of ids held a gigabyte. What every reader
of the prompt reads of it must stay the same: the differential tests below read each
prompt as sent (the seam's own RequestInfo) and as kept (parse_request's).
"""

from __future__ import annotations

import gc
import tracemalloc
from typing import Any

import orjson
import pytest

from proxy.core.apis import RequestInfo, api_for
from proxy.core.fingerprint import message_chain, of_prompt
from proxy.core.llamacpp import several_prompts
from proxy.core.request import TokenIds, parse_request
from proxy.core.tokens import count_echoed, count_request, load_tokenizer
from tests.tokenizers_local import build_tiny_tokenizer

#: Enough ids that keeping them shows (about 7 MB decoded), past CPython's cached small
#: ints as real ids are.
N = 200_000
IDS = list(range(1000, 1000 + N))
#: What a kept RequestInfo may hold beyond the body it was read from: a few small objects.
HELD_BOUND = 64 * 1024


def held_after_parse(path: str, obj: dict[str, Any]) -> tuple[RequestInfo, int]:
    """parse_request's RequestInfo for `obj` sent to `path`, and the bytes still allocated
    once the decoded body is gone (as after admission) with the RequestInfo kept."""
    body = orjson.dumps(obj)
    gc.collect()
    tracemalloc.start()
    try:
        info, decoded = parse_request(path, body)
        del decoded
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return info, held


@pytest.mark.parametrize(
    ("path", "obj", "prompt"),
    [
        ("/v1/completions", {"model": "m", "prompt": IDS}, TokenIds(N)),
        ("/v1/completions", {"prompt": [IDS, IDS[:5]]}, [TokenIds(N), TokenIds(5)]),
        ("/v1/completions", {"prompt": ["a text", IDS]}, ["a text", TokenIds(N)]),
        ("/invocations", {"prompt": IDS}, TokenIds(N)),
        ("/inference/v1/generate", {"token_ids": IDS, "sampling_params": {}}, TokenIds(N)),
        ("/v1/embeddings", {"input": IDS}, TokenIds(N)),
        ("/v1/embeddings", {"input": [IDS, IDS[:5]]}, [TokenIds(N), TokenIds(5)]),
        ("/pooling", {"input": IDS}, TokenIds(N)),
        ("/classify", {"input": [IDS]}, [TokenIds(N)]),
        ("/completion", {"prompt": IDS}, TokenIds(N)),  # llama-server's own
        ("/completion", {"prompt": [IDS, "a text"]}, [TokenIds(N), "a text"]),
        # Ollama's `context` (the ids of an earlier answer) is read by no reader: never kept
        ("/api/generate", {"model": "m", "prompt": "hi", "context": IDS}, "hi"),
    ],
)
def test_a_token_id_prompt_is_kept_as_its_count(
    path: str, obj: dict[str, Any], prompt: Any
) -> None:
    info, held = held_after_parse(path, obj)
    assert info.prompt == prompt
    assert held < HELD_BOUND  # the ids themselves: about 7 MB


def test_echoed_token_ids_are_kept_as_their_count() -> None:
    """Completions' `echo` keeps each choice's prompt (n of each): ids by their count."""
    obj = {"prompt": [IDS, IDS[:5]], "echo": True, "n": 3}
    info, held = held_after_parse("/v1/completions", obj)
    assert info.echoed == (TokenIds(N),) * 3 + (TokenIds(5),) * 3
    assert held < HELD_BOUND
    single, held = held_after_parse("/v1/completions", {"prompt": IDS, "echo": True, "n": 2})
    assert single.echoed == (TokenIds(N), TokenIds(N)) and held < HELD_BOUND


def test_generate_still_knows_its_prompt_tokens_exactly() -> None:
    info, _ = held_after_parse("/inference/v1/generate", {"token_ids": IDS, "stream": True})
    assert info.prompt_tokens == N and info.stream


def test_prompts_without_token_ids_are_the_ones_sent() -> None:
    """Texts and messages are what the tokenizer, the fingerprint and the span read: kept
    as sent, the same objects (no copy, no second RequestInfo)."""
    messages = [{"role": "user", "content": "hi"}]
    chat, obj = parse_request("/v1/chat/completions", orjson.dumps({"messages": messages}))
    assert chat.prompt == messages and obj is not None and chat.prompt is obj["messages"]
    texts, obj = parse_request("/v1/completions", orjson.dumps({"prompt": ["a", "b"]}))
    assert obj is not None and texts.prompt is obj["prompt"]


# -- what the readers read: the same of a kept prompt as of the prompt as sent ------------

PROMPTS = [
    [5, 6, 7],  # token ids: one prompt
    [[5, 6, 7], [8]],  # a batch of them
    [[5, 6, 7]],
    ["the quick brown fox", [5, 6]],  # texts and ids, a batch
    [5, [6, 7]],  # an id beside a list: one prompt (llama-server), no count
    [5, "a text"],  # llama-server's mixed prompt: as sent
    [[]],
    ["once upon", "a time"],
    "once upon a time",
    [],
]
PATHS = ["/v1/completions", "/completion", "/v1/embeddings"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_tokenizer(str(build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))))


def as_sent_and_kept(path: str, obj: dict[str, Any]) -> tuple[RequestInfo, RequestInfo]:
    api = api_for(path)
    assert api is not None
    return api.read_request(obj), parse_request(path, orjson.dumps(obj))[0]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("prompt", PROMPTS, ids=repr)
def test_readers_read_a_kept_prompt_as_the_prompt_sent(path: str, prompt: Any) -> None:
    key = "input" if path == "/v1/embeddings" else "prompt"
    sent, kept = as_sent_and_kept(path, {key: prompt, "n": 2, "echo": True})
    assert several_prompts(kept.prompt) == several_prompts(sent.prompt)
    assert of_prompt(kept.prompt) == of_prompt(sent.prompt)  # the fingerprint
    assert message_chain(kept.prompt) == message_chain(sent.prompt)  # the conversation table
    assert kept.choices_due == sent.choices_due
    assert len(kept.echoed) == len(sent.echoed)
    api = api_for(path)
    assert api is not None
    shown, shown_sent = api.input_messages(kept.prompt), api.input_messages(sent.prompt)
    # the span's messages; a list of ids as sent showed on the default seam as `[]` (below)
    ids_alone = isinstance(kept.prompt, TokenIds) and shown_sent == [] and shown is None
    assert shown == shown_sent or ids_alone


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("prompt", PROMPTS, ids=repr)
def test_the_tokenizer_counts_a_kept_prompt_as_the_prompt_sent(
    tokenizer: Any, path: str, prompt: Any
) -> None:
    """Without usage, a tokenizer counts the prompt, and a completions output less its
    echoed prompt: a list of ids as its length (proxy/core/tokens.py)."""
    key = "input" if path == "/v1/embeddings" else "prompt"
    sent, kept = as_sent_and_kept(path, {key: prompt, "n": 2, "echo": True})
    assert count_request(tokenizer, kept) == count_request(tokenizer, sent)
    assert count_echoed(tokenizer, list(kept.echoed)) == count_echoed(tokenizer, list(sent.echoed))


def test_a_token_id_input_has_no_input_messages() -> None:
    """A list of ids holds no message: the span shows none for it, on every seam (the
    default seam's reading of a list as sent kept its dicts: none, an empty list)."""
    for path in ("/v1/completions", "/v1/embeddings", "/v1/chat/completions"):
        api = api_for(path)
        assert api is not None
        assert api.input_messages(TokenIds(3)) is None
