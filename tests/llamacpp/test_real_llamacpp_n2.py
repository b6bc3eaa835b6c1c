"""`n` > 1 against a real llama-server through a real `tokenprobe serve`: every choice is a
task of its own (docs/llamacpp.md), and the record counts what llama-server generated.

llama-server refuses `n` above its slots ("Field 'n': Value must be between 1 <= value <=
1"), so this module starts a server of its own with two slots and `--metrics` (its
`llamacpp:tokens_predicted_total` is the generated count to agree with), leaving the
session's one-slot server as it is."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.llamacpp.conftest import (
    FLAGS,
    MODEL,
    SERVED,
    START_TIMEOUT,
    Llama,
    _stop,
    _wait_healthy,
    llama_server,
)
from tests.pairs import payloads
from tests.servers import free_port, serve_in_front

pytestmark = [pytest.mark.llamacpp, pytest.mark.timeout(600)]

#: The session server's flags with two slots instead of one.
TWO_SLOTS = tuple("2" if FLAGS[i - 1] == "--parallel" else f for i, f in enumerate(FLAGS))
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def llama2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Llama]:
    server = llama_server()
    logs: Path = tmp_path_factory.mktemp("llama2")
    argv = [str(server), "--model", str(MODEL), "--host", "127.0.0.1", "--metrics", *TWO_SLOTS]
    for _ in range(5):
        port = free_port()
        log = logs / "llama-server.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                [*argv, "--port", str(port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        llama = Llama(process, log, f"http://127.0.0.1:{port}")
        if _wait_healthy(llama, time.monotonic() + START_TIMEOUT):
            break
        _stop(llama)
    else:
        raise AssertionError(f"llama-server did not start: see {logs}")
    try:
        llama.access_log = logs / "proxy.jsonl"
        llama.proxy, llama.proxy_url = serve_in_front(llama.url, llama.access_log, "llama-server")
        yield llama
    finally:
        _stop(llama)


def predicted(llama: Llama) -> float:
    """llama-server's own count of the tokens it generated so far."""
    page = httpx.get(llama.url + "/metrics", timeout=10).text
    found = re.search(r"^llamacpp:tokens_predicted_total ([0-9.e+]+)$", page, re.M)
    assert found is not None, page
    return float(found.group(1))


def ask(llama: Llama, path: str, body: dict[str, Any]) -> tuple[bytes, dict[str, Any], float]:
    """The client's bytes, the proxy's record and what llama-server generated for them."""
    since = len(llama.log_lines())
    before = predicted(llama)
    with httpx.stream("POST", llama.proxy_url + path, json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        raw = b"".join(response.iter_raw())
    deadline = time.monotonic() + 30
    while not llama.log_lines(since) and time.monotonic() < deadline:
        time.sleep(0.05)
    (record,) = llama.log_lines(since)
    return raw, record, predicted(llama) - before


CHAT = {"model": SERVED, "messages": [{"role": "user", "content": "tell me a story"}]}
COMPLETIONS = {"model": SERVED, "prompt": "once upon a time"}


@pytest.mark.parametrize(
    ("path", "base", "extra", "source"),
    [
        ("/v1/chat/completions", CHAT, {}, "engine"),  # n > 1: the proxy asks for no usage
        ("/v1/chat/completions", CHAT, {"stream_options": {"include_usage": True}}, "usage"),
        ("/v1/completions", COMPLETIONS, {}, "usage"),
    ],
    ids=["chat", "chat-include-usage", "completions"],
)
def test_a_stream_of_two_choices_counts_both_tasks_and_the_prompt_once(
    llama2: Llama, path: str, base: dict[str, Any], extra: dict[str, Any], source: str
) -> None:
    body = {**base, "n": 2, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True, **extra}
    raw, record, generated = ask(llama2, path, {**body, "cache_prompt": False})
    timings = [p["timings"] for p in payloads(raw) if "timings" in p]
    assert len(timings) == 2  # a task a choice, each with its own account
    assert generated == sum(t["predicted_n"] for t in timings) == 2 * MAX_TOKENS
    assert (record["output_tokens"], record["token_source"]) == (generated, source)
    assert record["prompt_tokens"] == timings[0]["prompt_n"] + timings[0]["cache_n"]
    usages = [p["usage"] for p in payloads(raw) if "usage" in p]
    if extra or path == "/v1/completions":
        assert [u["completion_tokens"] for u in usages] == [MAX_TOKENS, MAX_TOKENS]
        assert record["prompt_tokens"] == usages[0]["prompt_tokens"]  # once, not once a task


@pytest.mark.parametrize(
    ("path", "base"),
    [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETIONS)],
    ids=["chat", "completions"],
)
def test_a_body_of_two_choices_claims_no_output_from_the_first_tasks_usage(
    llama2: Llama, path: str, base: dict[str, Any]
) -> None:
    """Not streamed, llama-server answers the first task's object with the other task's
    choice appended (server-context.cpp, handle_completions_impl): its usage and timings
    count that task alone. The prompt is the request's; the output is not claimed from
    them (it was: MAX_TOKENS of 2 x MAX_TOKENS generated, source usage)."""
    body = {**base, "n": 2, "max_tokens": MAX_TOKENS, "temperature": 0, "cache_prompt": False}
    raw, record, generated = ask(llama2, path, body)
    answer = orjson.loads(raw)
    assert len(answer["choices"]) == 2
    assert generated == 2 * MAX_TOKENS
    assert answer["usage"]["completion_tokens"] == answer["timings"]["predicted_n"] == MAX_TOKENS
    assert record["prompt_tokens"] == answer["usage"]["prompt_tokens"]
    assert (record["output_tokens"], record["token_source"]) == (None, "none")
