"""Issue 27 item 3: cached prompt tokens from Anthropic cache reads feed the cache class,
as vLLM's cached_tokens do (the prefix-cache panels work for both)."""

from __future__ import annotations

import anthropic

from tests.conftest import MODEL, ProxyUnderTest

HISTOGRAM = "tokenprobe_time_to_first_token_by_prompt_seconds_count"


def test_anthropic_cache_reads_are_cached_prompt_tokens_and_set_the_cache_class(
    proxy: ProxyUnderTest,
) -> None:
    client = anthropic.Anthropic(base_url=proxy.url, api_key="x", max_retries=0)
    text = "The quick brown fox jumps over the lazy dog. " * 8  # 90 prompt tokens
    with client.messages.stream(
        model=MODEL,
        max_tokens=16,
        messages=[{"role": "user", "content": text}],
        extra_headers={"x-sim-cached-tokens": "80"},
    ) as stream:
        final = stream.get_final_message()
    read = final.usage.cache_read_input_tokens
    assert read == 80
    m = proxy.wait_records(1, exact=True)[0]
    assert m.endpoint == "/v1/messages" and m.cached_prompt_tokens == read
    assert m.prompt_tokens == final.usage.input_tokens + read
    labels = {"model": MODEL, "endpoint": "/v1/messages", "prompt_class": "0-1k"}
    assert proxy.sample(HISTOGRAM, **labels, cache_class="most") == 1
    assert (
        proxy.sample("tokenprobe_cached_prompt_tokens_total", model=MODEL, endpoint="/v1/messages")
        == read
    )
