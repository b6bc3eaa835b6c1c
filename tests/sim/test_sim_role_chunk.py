"""Chat's role-only chunk goes out as vLLM 0.32 sends it: with the first engine output,
just before that output's chunk (vllm/entrypoints/openai/chat_completion/serving.py,
chat_completion_stream_generator: `first_iteration`, one role chunk per choice, with
continuous usage counting 0 completion tokens), so at the TTFT, not with the headers.
`x-sim-early-role: 1` (`--early-role`) sends it with the headers instead, for tests and
demos that want the shape that tells the role chunk from the first token.

Timing bounds are lower bounds (a loaded box is late, never early), but for the early
role chunk's, read in `best_of`.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from proxy.sim import SimApp, SimConfig, completion_text
from proxy.sim.cli import parse
from proxy.sim.controls import Plan, plan_request
from tests.servers import ThreadedServer
from tests.sim.test_sim_support import Event, best_of, chat, read_events, running

TTFT = 0.25
EARLY = 0.003  # a wake-up this early is a bug, not load
ROLE = {"role": "assistant", "content": ""}


@pytest.fixture(scope="module")
def sim() -> Iterator[tuple[ThreadedServer, SimApp]]:
    config = SimConfig(ttft=TTFT, tokens_per_second=200, output_tokens=3)
    with running(config) as pair:
        yield pair


def delta(event: Event) -> dict[str, object]:
    return dict(event.json["choices"][0]["delta"])


def test_the_role_chunk_goes_out_with_the_first_token(client: httpx.Client, url: str) -> None:
    got = read_events(client, url, chat())
    role, first = got.events[0], got.events[1]
    assert delta(role) == ROLE and delta(first) == {"content": completion_text(1)}
    # a client that takes the first chunk with `choices` for the first token (vllm bench
    # serve's openai-chat backend) reads vLLM's TTFT
    assert role.at >= TTFT - EARLY, role.at
    assert got.text() == completion_text(3)


def test_every_choices_role_chunk_goes_before_the_first_tokens(
    client: httpx.Client, url: str
) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    got = read_events(client, url, chat(n=2, temperature=1, stream_options=options))
    chunks = [e.json for e in got.events[:4]]
    assert [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in chunks] == [
        (0, ROLE),
        (1, ROLE),
        (0, {"content": completion_text(1)}),
        (1, {"content": completion_text(1)}),
    ]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 0, 1, 1]
    assert chunks[0]["usage"]["total_tokens"] == chunks[0]["usage"]["prompt_tokens"]
    assert min(e.at for e in got.events[:2]) >= TTFT - EARLY


def test_an_empty_completions_role_chunk_goes_with_its_eos(client: httpx.Client, url: str) -> None:
    got = read_events(client, url, chat(), {"x-sim-output-tokens": "0"})
    assert [delta(e) for e in got.events[:2]] == [ROLE, {"content": ""}]
    assert got.events[1].json["choices"][0]["finish_reason"] == "stop"
    assert got.events[0].at >= TTFT - EARLY


def test_an_error_at_the_first_output_follows_the_role_chunk(
    client: httpx.Client, url: str
) -> None:
    """vLLM's GenerationError (`_raise_if_error`) is raised in the loop over the outputs,
    after `first_iteration` sent the role chunks."""
    got = read_events(client, url, chat(), {"x-sim-fault": "error_event"})
    assert delta(got.events[0]) == ROLE and got.events[0].at >= TTFT - EARLY
    assert got.events[1].json["error"]["message"] == "Internal server error"
    assert got.events[2].data == b"[DONE]" and len(got.events) == 3


def test_a_stall_holds_the_role_chunk_back_with_the_first_token(
    client: httpx.Client, url: str
) -> None:
    got = read_events(client, url, chat(), {"x-sim-fault": "stall", "x-sim-stall": "0.2"})
    assert delta(got.events[0]) == ROLE and got.events[0].at >= TTFT + 0.2 - EARLY


def test_a_stream_cut_before_its_first_output_sends_no_role_chunk(
    client: httpx.Client, url: str
) -> None:
    got = read_events(client, url, chat(), {"x-sim-fault": "close_no_done"})
    assert got.status == 200 and got.events == []


def test_a_scripts_role_chunk_goes_out_with_its_first_token(client: httpx.Client, url: str) -> None:
    got = read_events(client, url, chat(), {"x-sim-reasoning-tokens": "2"})
    assert delta(got.events[0]) == ROLE and got.events[0].at >= TTFT - EARLY
    assert "reasoning" in delta(got.events[1])


@pytest.mark.quiet("a timing read within tens of milliseconds")
@pytest.mark.parametrize("headers", [{}, {"x-sim-reasoning-tokens": "2"}], ids=["plain", "script"])
def test_x_sim_early_role_sends_the_role_chunk_with_the_headers(
    client: httpx.Client, url: str, headers: dict[str, str]
) -> None:
    def attempt() -> None:
        got = read_events(client, url, chat(), {**headers, "x-sim-early-role": "1"})
        assert delta(got.events[0]) == ROLE and got.events[0].at < 0.1
        assert got.events[1].at >= TTFT - EARLY

    best_of(3, attempt)


def early_role(headers: dict[str, str], config: SimConfig) -> bool:
    planned = plan_request("chat", chat(), headers, config)
    assert isinstance(planned, Plan)
    return planned.early_role


def test_early_role_is_a_flag_and_a_header_that_can_turn_it_off() -> None:
    config, _ = parse(["--early-role"], {})
    assert config.early_role and not parse([], {})[0].early_role
    assert parse([], {"TOKENPROBE_SIM_EARLY_ROLE": "1"})[0].early_role
    assert early_role({}, config) and not early_role({"x-sim-early-role": "0"}, config)
    assert early_role({"x-sim-early-role": "1"}, SimConfig())
    assert not early_role({}, SimConfig())
