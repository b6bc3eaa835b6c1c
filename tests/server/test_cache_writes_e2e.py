"""Prompt tokens written to the prefix cache, and the backend's system_fingerprint, end to
end: the simulator answers as vLLM 0.32 with --enable-prompt-tokens-details
(`x-sim-cached-tokens`; its writes are the prompt's whole 16-token blocks not found cached),
real SDK clients ask through the proxy, and the record, the access log line and /metrics
say what the backend's usage said, the client's answer unchanged."""

from __future__ import annotations

import io
import json
from collections.abc import Callable

import anthropic
import openai
import pytest

from proxy.core.measurement import Measurement
from proxy.sinks.logs import AccessLog
from tests.conftest import MODEL, ProxyUnderTest, Running

FINGERPRINT = "vllm-0.32.0-51eb094b"
TEXT = "The quick brown fox jumps over the lazy dog. " * 8  # 90 prompt tokens or so
NOTHING_CACHED = {"x-sim-cached-tokens": "0"}  # the details on, nothing found cached
WRITES = "tokenprobe_cache_write_prompt_tokens_total"


@pytest.fixture
def sim(start_sim: Callable[..., Running]) -> Running:
    return start_sim(
        ttft=0.0, tokens_per_second=2000.0, output_tokens=8, system_fingerprint=FINGERPRINT
    )


@pytest.fixture
def log() -> io.StringIO:
    return io.StringIO()


@pytest.fixture
def proxy(
    sim: Running, start_proxy: Callable[..., ProxyUnderTest], log: io.StringIO
) -> ProxyUnderTest:
    return start_proxy(sim.url, sinks=[AccessLog("json", stream=log)])


def only_record(proxy: ProxyUnderTest, log: io.StringIO) -> tuple[Measurement, dict[str, object]]:
    (m,) = proxy.wait_records(1, exact=True)
    (line,) = log.getvalue().splitlines()
    return m, json.loads(line)


def whole_blocks(prompt_tokens: int | None) -> int:
    assert prompt_tokens is not None and prompt_tokens >= 16
    return prompt_tokens - prompt_tokens % 16


def test_a_chat_stream_s_hidden_usage_gives_the_writes_and_the_client_its_fingerprint(
    proxy: ProxyUnderTest, log: io.StringIO
) -> None:
    """The client asked for no usage: the proxy asks, reads the writes and the fingerprint
    from the usage chunk, and gives the client back the terminal chunk's fingerprint."""
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": TEXT}],
            max_tokens=8,
            stream=True,
            extra_headers=NOTHING_CACHED,
        )
    )
    assert all(c.usage is None for c in chunks)
    terminal = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.system_fingerprint for c in terminal] == [FINGERPRINT]
    m, line = only_record(proxy, log)
    written = whole_blocks(m.prompt_tokens)
    assert (m.cached_prompt_tokens, m.cache_write_tokens, m.system_fingerprint) == (
        0,
        written,
        FINGERPRINT,
    )
    assert (line["cache_write_tokens"], line["system_fingerprint"]) == (written, FINGERPRINT)
    assert proxy.sample(WRITES, model=MODEL, endpoint="/v1/chat/completions") == written


def test_a_whole_chat_answer_s_writes_are_its_usage_s(
    proxy: ProxyUnderTest, log: io.StringIO
) -> None:
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": TEXT}],
        max_tokens=8,
        extra_headers={"x-sim-cached-tokens": "16"},
    )
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    details = answer.usage.prompt_tokens_details
    said = (details.model_extra or {})["created_cache_tokens"]  # vLLM's, not OpenAI's name
    assert said == whole_blocks(answer.usage.prompt_tokens) - 16 > 0
    m, line = only_record(proxy, log)
    assert (m.prompt_tokens, m.cached_prompt_tokens, m.cache_write_tokens) == (
        answer.usage.prompt_tokens,
        16,
        said,
    )
    assert (line["cache_write_tokens"], line["system_fingerprint"]) == (said, FINGERPRINT)
    assert answer.system_fingerprint == m.system_fingerprint == FINGERPRINT


def test_a_messages_stream_s_writes_are_its_cache_creation_and_in_its_prompt(
    proxy: ProxyUnderTest, log: io.StringIO
) -> None:
    """Anthropic's input_tokens leaves out reads and writes: the prompt is all three."""
    client = anthropic.Anthropic(base_url=proxy.url, api_key="x", max_retries=0)
    with client.messages.stream(
        model=MODEL,
        max_tokens=8,
        messages=[{"role": "user", "content": TEXT}],
        extra_headers={"x-sim-cached-tokens": "16"},
    ) as stream:
        final = stream.get_final_message()
    usage = final.usage
    assert usage.cache_read_input_tokens == 16
    assert usage.cache_creation_input_tokens is not None and usage.cache_creation_input_tokens > 0
    m, line = only_record(proxy, log)
    assert m.prompt_tokens == usage.input_tokens + 16 + usage.cache_creation_input_tokens
    assert (m.cached_prompt_tokens, m.cache_write_tokens) == (16, usage.cache_creation_input_tokens)
    assert (line["cache_write_tokens"], line["system_fingerprint"]) == (
        usage.cache_creation_input_tokens,
        None,
    )
    assert (
        proxy.sample(WRITES, model=MODEL, endpoint="/v1/messages")
        == usage.cache_creation_input_tokens
    )


def test_a_responses_stream_s_writes_are_its_cache_write_tokens(
    proxy: ProxyUnderTest, log: io.StringIO
) -> None:
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    with client.responses.stream(model=MODEL, input=TEXT, max_output_tokens=8) as stream:
        done = stream.get_final_response()
    assert done.usage is not None
    details = done.usage.input_tokens_details
    assert details.cache_write_tokens == whole_blocks(done.usage.input_tokens)
    m, line = only_record(proxy, log)
    assert (m.cached_prompt_tokens, m.cache_write_tokens) == (
        details.cached_tokens,
        details.cache_write_tokens,
    )
    assert line["cache_write_tokens"] == details.cache_write_tokens
    assert proxy.sample(WRITES, model=MODEL, endpoint="/v1/responses") == details.cache_write_tokens
