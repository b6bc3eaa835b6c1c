"""Messages' `message_start` and Cohere's `message-start` go out as vLLM 0.32 sends them:
with the first engine output, not with the headers. vLLM builds both from the chat stream's
first chunk (vllm/entrypoints/anthropic/serving.py message_stream_converter, `first_item`;
vllm/entrypoints/cohere/serving.py _chat_completion_stream_to_v2, `if not state.started`),
and that chunk is chat's role chunk, sent with the first engine output
(chat_completion/serving.py, `first_iteration`). So they come at the TTFT, just before the
content block's start and the first delta; with an empty answer's end; before an error at
the first output; late under a stall; never under a cut there. Responses' `response.created`
and `response.in_progress` are yielded before the engine's first output is read
(responses/serving.py responses_stream_generator) and still go out at once.
`x-sim-early-role: 1` (`--early-role`) puts the start events back with the headers.

Timing bounds are lower bounds (a loaded box is late, never early), but for the ones read
in `best_of`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest

from proxy.sim import SimApp, SimConfig, completion_text
from tests.servers import ThreadedServer
from tests.sim.test_sim_support import best_of, read_events, read_named_events, running

TTFT = 0.25
GAP = 0.2  # between tokens: 5 a second
EARLY = 0.003  # a wake-up this early is a bug, not load
MESSAGES, COHERE = "/v1/messages", "/cohere/v2/chat"
Events = list[tuple[str, float]]  # (name, arrival)


@pytest.fixture(scope="module")
def sim() -> Iterator[tuple[ThreadedServer, SimApp]]:
    config = SimConfig(ttft=TTFT, tokens_per_second=1 / GAP, output_tokens=2)
    with running(config) as pair:
        yield pair


def body(**extra: object) -> dict[str, object]:
    return {
        "model": "sim-model",
        "max_tokens": 50,
        "messages": [{"role": "user", "content": "Say something."}],
        "stream": True,
        **extra,
    }


def messages(client: httpx.Client, url: str, headers: dict[str, str], **extra: object) -> Events:
    """A Messages stream's events as (name, arrival)."""
    got = read_named_events(client, url, MESSAGES, body(**extra), headers)
    assert got.status == 200
    return [(e.name, e.at) for e in got.events]


def cohere(client: httpx.Client, url: str, headers: dict[str, str], **extra: object) -> Events:
    """A Cohere stream's events as (type, arrival); `[DONE]` as "DONE"."""
    got = read_events(client, url, body(**extra), headers, path=COHERE)
    assert got.status == 200
    return [("DONE" if e.data == b"[DONE]" else e.json["type"], e.at) for e in got.events]


def names(events: Events) -> list[str]:
    return [name for name, _ in events]


def at(events: Events, name: str) -> float:
    return next(when for n, when in events if n == name)


Reader = Callable[..., Events]
BOTH = pytest.mark.parametrize(
    ("read", "start"), [(messages, "message_start"), (cohere, "message-start")]
)


def test_message_start_goes_out_with_the_first_token(client: httpx.Client, url: str) -> None:
    got = messages(client, url, {})
    assert names(got)[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert at(got, "message_start") >= TTFT - EARLY


def test_cohere_message_start_goes_out_with_the_first_token(client: httpx.Client, url: str) -> None:
    got = cohere(client, url, {})
    assert names(got)[:3] == ["message-start", "content-start", "content-delta"]
    assert at(got, "message-start") >= TTFT - EARLY


def test_an_empty_answers_start_goes_out_with_its_end(client: httpx.Client, url: str) -> None:
    """The EOS is the first engine output: the role chunk, then the finish chunk whose
    empty text opens no block."""
    empty = {"x-sim-output-tokens": "0"}
    got = messages(client, url, empty)
    assert names(got) == ["message_start", "message_delta", "message_stop"]
    assert at(got, "message_start") >= TTFT - EARLY
    got = cohere(client, url, empty)
    assert names(got) == ["message-start", "message-end", "DONE"]
    assert at(got, "message-start") >= TTFT - EARLY


def test_an_error_at_the_first_output_follows_the_start(client: httpx.Client, url: str) -> None:
    """vLLM's GenerationError is raised after `first_iteration` sent the role chunk, so the
    converters have sent their start event when the error chunk comes."""
    fault = {"x-sim-fault": "error_event"}
    got = messages(client, url, fault)
    assert names(got) == ["message_start", "error"]
    assert at(got, "message_start") >= TTFT - EARLY
    got = cohere(client, url, fault)
    assert names(got) == ["message-start", "message-end", "DONE"]
    assert at(got, "message-start") >= TTFT - EARLY


@BOTH
def test_a_stall_holds_the_start_back_with_the_first_token(
    client: httpx.Client, url: str, read: Reader, start: str
) -> None:
    got = read(client, url, {"x-sim-fault": "stall", "x-sim-stall": "0.2"})
    assert names(got)[0] == start and at(got, start) >= TTFT + 0.2 - EARLY


@pytest.mark.parametrize("path", [MESSAGES, COHERE])
def test_a_stream_cut_before_its_first_output_sends_no_start(
    client: httpx.Client, url: str, path: str
) -> None:
    reply = client.post(url + path, json=body(), headers={"x-sim-fault": "close_no_done"})
    assert reply.status_code == 200 and reply.content == b""


def test_the_ping_knob_goes_with_message_start(client: httpx.Client, url: str) -> None:
    got = messages(client, url, {"x-sim-ping": "1"})
    assert names(got)[:3] == ["message_start", "ping", "content_block_start"]
    assert at(got, "ping") >= TTFT - EARLY


@BOTH
def test_a_scripts_start_goes_out_with_its_first_token(
    client: httpx.Client, url: str, read: Reader, start: str
) -> None:
    got = read(client, url, {"x-sim-reasoning-tokens": "2"})
    assert names(got)[0] == start and at(got, start) >= TTFT - EARLY


@pytest.mark.quiet("a timing read within tens of milliseconds")
def test_the_start_goes_with_the_first_step_even_when_its_text_is_held(
    client: httpx.Client, url: str
) -> None:
    """A stop string that may still match holds the first token's text back, so the first
    step sends no delta; its role chunk, hence message_start, still goes with it. Cut to
    nothing: the stop completes at the third token, two steps later."""

    def attempt() -> None:
        stop = [completion_text(3)]
        got = messages(client, url, {"x-sim-output-tokens": "8"}, stop_sequences=stop)
        assert names(got) == ["message_start", "message_delta", "message_stop"]
        start, end = at(got, "message_start"), at(got, "message_delta")
        assert start >= TTFT - EARLY and end >= TTFT + 2 * GAP - EARLY
        assert end - start >= GAP, (start, end)

    best_of(3, attempt)


@pytest.mark.quiet("a timing read within tens of milliseconds")
@BOTH
@pytest.mark.parametrize("script", [{}, {"x-sim-reasoning-tokens": "2"}], ids=["plain", "script"])
def test_x_sim_early_role_sends_the_start_with_the_headers(
    client: httpx.Client, url: str, read: Reader, start: str, script: dict[str, str]
) -> None:

    def attempt() -> None:
        got = read(client, url, {**script, "x-sim-early-role": "1"})
        assert names(got)[0] == start and at(got, start) < 0.1
        assert got[1][1] >= TTFT - EARLY  # the block's start and its text: at the TTFT

    best_of(3, attempt)


@pytest.mark.quiet("a timing read within tens of milliseconds")
def test_responses_created_and_in_progress_still_go_out_at_once(
    client: httpx.Client, url: str
) -> None:
    def attempt() -> None:
        request = {"model": "sim-model", "input": "Say something.", "stream": True}
        got = read_named_events(client, url, "/v1/responses", request)
        assert got.names()[:2] == ["response.created", "response.in_progress"]
        assert got.events[1].at < 0.1
        assert got.first("response.output_text.delta").at >= TTFT - EARLY

    best_of(3, attempt)
