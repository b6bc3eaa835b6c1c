"""Where vLLM 0.32 puts a choice's finish, how it streams `n` choices, and how it ends a
choice at a stop string: the simulator against real vLLM 0.32 captures
(tests/fixtures/streams/vllm-0.32) and, where no capture exists, vLLM's serving code
(vllm/entrypoints/openai/chat_completion/serving.py, completion/serving.py,
vllm/v1/engine/detokenizer.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import orjson
import pytest

from proxy.sim import SimApp, SimConfig, completion_text
from tests.paths import STREAMS
from tests.servers import ThreadedServer
from tests.sim.test_sim_support import Streamed, chat, read_events, running

FP = "vllm-0.32.0-sim"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
REAL = STREAMS / "vllm-0.32"
#: Members of real chunks that the simulator does not send (request options it ignores).
NOT_SIMULATED = frozenset({"prompt_token_ids", "prompt_text", "token_ids"})


@pytest.fixture(scope="module")
def sim() -> Iterator[tuple[ThreadedServer, SimApp]]:
    config = SimConfig(
        ttft=0.0, tokens_per_second=1000.0, output_tokens=8, per_request_metrics=True,
        system_fingerprint=FP,
    )  # fmt: skip
    with running(config) as pair:
        yield pair


def completion(stream: bool = True, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "prompt": "once upon", "stream": stream, **extra}


def skeleton(payloads: list[bytes]) -> list[object]:
    """Each event as these tests compare it: its members, and each choice's index, members,
    whether its text is empty, and finish and stop reasons (the values that differ between
    two runs, and the members the simulator does not send, left out)."""
    out: list[object] = []
    for payload in payloads:
        if payload == b"[DONE]":
            out.append("DONE")
            continue
        chunk = orjson.loads(payload)
        choices = []
        for choice in chunk["choices"]:
            text = choice["delta"].get("content") if "delta" in choice else choice["text"]
            delta = sorted(choice["delta"]) if "delta" in choice else None
            members = [k for k in choice if k not in NOT_SIMULATED]
            reasons = (choice["finish_reason"], choice.get("stop_reason", "absent"))
            choices.append((choice["index"], members, delta, bool(text), reasons))
        members = [k for k in chunk if k not in NOT_SIMULATED]
        usage = chunk.get("usage") and chunk["usage"]["completion_tokens"]
        out.append((members, choices, usage))
    return out


def payloads(raw: bytes) -> list[bytes]:
    return [e[len(b"data: ") :] for e in raw.split(b"\n\n") if e]


# -- the finish of a choice cut by its token limit ------------------------------------


@pytest.mark.parametrize("usage", [False, True], ids=["no_usage", "include_usage"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_length_finish_rides_on_the_last_tokens_chunk_as_in_the_real_capture(
    client: httpx.Client, url: str, path: str, usage: bool
) -> None:
    """vLLM sends finish_reason with the engine output that ends the choice
    (chat_completion/serving.py:752-792, completion/serving.py:401-443): at the token
    limit that is the last token's, so no empty finish chunk follows it. The captures
    asked for max_tokens 6 (index.json); the simulator plans 8 tokens, so 6 is a limit."""
    name = ("chat" if path == CHAT else "completions") + (
        "_stream_include_usage.sse" if usage else "_stream_no_usage.sse"
    )
    real = payloads((REAL / name).read_bytes())
    extra: dict[str, Any] = {"max_tokens": 6}
    if usage:
        extra["stream_options"] = {"include_usage": True}
    body = chat(**extra) if path == CHAT else completion(**extra)
    got = read_events(client, url, body, path=path)
    assert skeleton([e.data for e in got.events]) == skeleton(real)
    assert got.text() == completion_text(6)


def test_a_forced_length_finish_ends_a_transcription_on_its_last_token(url: str) -> None:
    """The speech-to-text stream sends the finish with the output that carries it too
    (speech_to_text/base/serving.py:782-792)."""
    form = {"model": "sim-model", "stream": "true"}
    files = {"file": ("a.wav", b"\0" * 32000, "audio/wav")}
    headers = {"x-sim-finish-reason": "length", "x-sim-output-tokens": "3"}
    response = httpx.post(url + "/v1/audio/transcriptions", data=form, files=files,
                          headers=headers)  # fmt: skip
    chunks = [orjson.loads(p) for p in payloads(response.content)[:-1]]
    assert [c["choices"][0]["delta"]["content"] for c in chunks] == [
        completion_text(1, i) for i in range(3)
    ]
    assert [c["choices"][0].get("finish_reason") for c in chunks] == [None, None, "length"]


def test_an_eos_finish_still_comes_on_a_chunk_of_its_own_with_empty_text(
    client: httpx.Client, url: str
) -> None:
    """An EOS is a token without text (detokenizer.py:107-111 leaves it out of the text):
    its output carries only the finish."""
    got = read_events(client, url, chat())
    last_content, finish = got.events[-3].json["choices"][0], got.events[-2].json["choices"][0]
    assert (last_content["delta"], last_content["finish_reason"]) == (
        {"content": completion_text(1, 7)},
        None,
    )
    assert (finish["delta"], finish["finish_reason"]) == ({"content": ""}, "stop")


# -- n choices -------------------------------------------------------------------------


def by_choice(got: Streamed) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for event in got.events[:-1]:
        for choice in event.json["choices"]:
            out.setdefault(choice["index"], []).append(choice)
    return out


def choice_text(choices: list[dict[str, Any]]) -> str:
    return "".join(c["delta"].get("content") or "" if "delta" in c else c["text"] for c in choices)


def test_n_chat_choices_stream_one_chunk_each_per_step_in_index_order(
    client: httpx.Client, url: str
) -> None:
    """chat_completion/serving.py: a role chunk per choice first (549-589), then one chunk
    per choice and engine output, `index` its own (633-830; v1's RequestOutputCollector
    merges the n children's outputs of a step into one RequestOutput, in batch order:
    v1/engine/output_processor.py:69-83, vllm/outputs.py:203-247), a finish per choice,
    and the usage chunk: the prompt once, every choice's tokens (842); no `metrics` for
    n > 1 (866)."""
    body = chat(n=3, stream_options={"include_usage": True})
    got = read_events(client, url, body, {"x-sim-output-tokens": "4"})
    chunks = [e.json for e in got.events[:-1]]
    assert all(len(c["choices"]) == 1 for c in chunks[:-1])
    indexes = [c["choices"][0]["index"] for c in chunks[:-1]]
    assert indexes == [0, 1, 2] * 6  # roles, 4 tokens, finishes
    assert [c["choices"][0]["delta"] for c in chunks[:3]] == [
        {"role": "assistant", "content": ""}
    ] * 3
    for i, choices in by_choice(got).items():
        assert choice_text(choices) == completion_text(4), i
        assert [c["finish_reason"] for c in choices] == [None] * 5 + ["stop"]
    usage = chunks[-1]
    assert usage["choices"] == [] and "metrics" not in usage
    # each choice's 4 tokens and its EOS (the token of its finish chunk)
    assert usage["usage"] == {"prompt_tokens": 4, "total_tokens": 19, "completion_tokens": 15}
    assert got.events[-1].data == b"[DONE]"


def test_n_completion_choices_end_at_their_limit_each_with_the_fingerprint(
    client: httpx.Client, url: str, app: SimApp
) -> None:
    """completion/serving.py: no role chunk, a chunk per choice and output (`index`
    output.index, 327-443), each choice's last token carries its finish, and without a
    usage chunk each terminal chunk carries the fingerprint (425-432)."""
    got = read_events(client, url, completion(n=2, max_tokens=3), path=COMPLETIONS)
    chunks = [e.json["choices"][0] for e in got.events[:-1]]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in chunks] == [
        (i, completion_text(1, t), "length" if t == 2 else None) for t in range(3) for i in (0, 1)
    ]
    fingerprints = [e.json.get("system_fingerprint") for e in got.events[:-1]]
    assert fingerprints == [None] * 4 + [FP, FP]
    record = app.state.last()
    assert record is not None and record.completion_tokens == 6


def test_continuous_usage_counts_each_choices_own_tokens(client: httpx.Client, url: str) -> None:
    """chat_completion/serving.py:575-586 and 813-827: the role chunks count 0, every
    later chunk the tokens of its own choice so far."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = chat(n=2, stream_options=options)
    got = read_events(client, url, body, {"x-sim-output-tokens": "2"})
    counts = [
        (e.json["choices"][0]["index"], e.json["usage"]["completion_tokens"])
        for e in got.events[:-2]
    ]
    # the finish chunks carry each choice's EOS token (in output.token_ids: counted, 684)
    assert counts == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (0, 3), (1, 3)]
    assert got.events[-2].json["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_n_choices_not_streamed_are_a_list_with_the_tokens_summed(url: str, path: str) -> None:
    """chat_completion/serving.py:970-1130 (a choice per output, `index` output.index),
    1151-1153 (the tokens of all outputs) and 1177 (no `metrics` for n > 1: null, as
    the body is a whole model_dump());
    completion/serving.py:531-598 and 624."""
    body = chat(stream=False, n=2) if path == CHAT else completion(stream=False, n=2)
    answer = httpx.post(url + path, json=body, headers={"x-sim-output-tokens": "5"}).json()
    texts = [c["message"]["content"] if path == CHAT else c["text"] for c in answer["choices"]]
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert texts == [completion_text(5)] * 2
    # each choice's 5 text tokens and its EOS
    assert answer["usage"]["completion_tokens"] == 12 and answer["metrics"] is None


@pytest.mark.quiet("a duration read within a few hundred milliseconds")
def test_n_choices_decode_together_not_one_after_another(client: httpx.Client, url: str) -> None:
    """Each engine step gives every choice a token: four choices of 5 tokens at 20 tokens/s
    take the time of one (0.2 s), not four times it (0.8 s)."""
    headers = {"x-sim-output-tokens": "5", "x-sim-tps": "20"}
    t0 = time.monotonic()
    got = read_events(client, url, chat(n=4), headers)
    elapsed = time.monotonic() - t0
    assert len(by_choice(got)) == 4
    assert 0.2 - 0.01 <= elapsed < 0.5


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"n": 0}, "n must be at least 1, got 0."),
        ({"n": 16385}, "n must be at most 16384, got 16385."),
        ({"n": 2, "temperature": 0}, "n must be 1 when using greedy sampling, got 2."),
    ],
)
def test_n_that_vllm_refuses_is_its_400(url: str, extra: dict[str, Any], message: str) -> None:
    """vllm/sampling_params.py:46-59 (_verify_num_sequences, VLLM_MAX_N_SEQUENCES 16384)
    and 766-770 (_verify_greedy_sampling)."""
    r = httpx.post(url + CHAT, json=chat(stream=False, **extra))
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(message)


def test_n_as_text_is_read_as_vllms_models_read_it(url: str) -> None:
    answer = httpx.post(url + CHAT, json=chat(stream=False, n="2")).json()
    assert len(answer["choices"]) == 2


# -- stop strings -----------------------------------------------------------------------


def texts(got: Streamed) -> list[str]:
    return [
        e.json["choices"][0]["delta"].get("content", "")
        if "delta" in e.json["choices"][0]
        else e.json["choices"][0]["text"]
        for e in got.events[:-1]
        if e.json["choices"]
    ]


def test_a_stop_string_ends_the_choice_before_it_with_the_string_as_stop_reason(
    client: httpx.Client, url: str
) -> None:
    """vllm/v1/engine/detokenizer.py:96-156: the text is cut before the string and the
    tokens after the one that completes it are dropped; output_processor.py:766-774:
    finish_reason "stop", stop_reason the string. While a stop string is set, the streamed
    text holds back len(longest) - 1 characters until the output finishes (85-90, 161-175):
    here 2 of " The quick brown fox"."""
    body = chat(stop=["fox"], stream_options={"include_usage": True})
    got = read_events(client, url, body)
    assert texts(got) == ["", " T", "he qui", "ck bro", "wn "]
    last = got.events[-3].json["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", "fox")
    assert got.events[-2].json["usage"]["completion_tokens"] == 4  # " fox" included


def test_a_stop_string_not_streamed_cuts_the_text_and_counts_its_tokens(url: str) -> None:
    body = completion(stream=False, stop=" brown f")
    answer = httpx.post(url + COMPLETIONS, json=body).json()
    choice = answer["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (
        " The quick",
        "stop",
        " brown f",
    )
    assert answer["usage"]["completion_tokens"] == 4  # " fox" completes the string


def test_a_stop_string_kept_in_the_output_holds_nothing_back(
    client: httpx.Client, url: str
) -> None:
    """include_stop_str_in_output: no hold-back (detokenizer.py:87-90) and the text ends
    after the string (check_stop_strings, 365-370)."""
    body = completion(stop=["quick"], include_stop_str_in_output=True)
    got = read_events(client, url, body, path=COMPLETIONS)
    assert texts(got) == [" The", " quick"]
    assert got.events[-2].json["choices"][0]["stop_reason"] == "quick"


def test_a_stop_string_that_never_comes_releases_the_held_text_with_the_finish(
    client: httpx.Client, url: str
) -> None:
    """The EOS output finishes the choice, so it carries the characters held back."""
    got = read_events(client, url, chat(stop="xyz"), {"x-sim-output-tokens": "3"})
    assert texts(got) == ["", " T", "he qui", "ck bro", "wn"]
    finish = got.events[-2].json["choices"][0]
    assert (finish["finish_reason"], finish["stop_reason"]) == ("stop", None)


def test_a_stop_string_inside_a_speculative_step_drops_the_tokens_after_it(
    client: httpx.Client, url: str
) -> None:
    """Several tokens a step: those after the one that completes the string are dropped
    (detokenizer.py:143-151, output_processor.py:835-853)."""
    body = chat(stop=" fox", stream_options={"include_usage": True})
    got = read_events(client, url, body, {"x-sim-tokens-per-chunk": "3"})
    assert texts(got) == ["", " The quick br", "own"]
    assert got.events[-2].json["usage"]["completion_tokens"] == 4


def test_an_empty_stop_string_is_vllms_400(url: str) -> None:
    """vllm/sampling_params.py:731-733."""
    r = httpx.post(url + CHAT, json=chat(stream=False, stop=["a", ""]))
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "stop cannot contain an empty string."


#: vLLM 0.32's body for 5 stop strings, taken from its FastAPI app (the chat and completion
#: request models behind serve/exception_handling/handlers/validation.py).
TOO_MANY_STOPS = (
    b"{\"error\":{\"message\":\"2 validation errors:\\n  {'type': 'string_type', 'loc': "
    b"'body.stop', 'msg': 'Input should be a valid string', 'input': '<list of 5 items>'}"
    b"\\n  {'type': 'too_long', 'loc': 'body.stop', 'msg': 'List should have at most 4 "
    b"items after validation, not 5', 'input': '<list of 5 items>', 'ctx': {'field_type': "
    b"'List', 'max_length': 4, 'actual_length': 5}}\",\"type\":\"Bad Request\","
    b'"param":"body.stop","code":400}}'
)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_more_stop_strings_than_vllm_allows_is_its_validation_400(url: str, path: str) -> None:
    """generate/base/protocol.py:26-28 (StopParam: a list of at most VLLM_MAX_STOP_STRINGS,
    envs.py:114, default 4); four are served."""
    make = chat if path == CHAT else completion
    r = httpx.post(url + path, json=make(stream=False, stop=["a1", "b1", "c1", "d1", "e1"]))
    assert (r.status_code, r.content) == (400, TOO_MANY_STOPS)
    assert httpx.post(url + path, json=make(stream=False, stop=["a", "b", "c", "d"])).is_success


def test_the_stop_string_limit_is_vllms_environment_variable() -> None:
    from proxy.sim.cli import parse

    assert parse([], {})[0].max_stop_strings == 4
    assert parse([], {"VLLM_MAX_STOP_STRINGS": "6"})[0].max_stop_strings == 6


# -- min_tokens ---------------------------------------------------------------------------


def test_a_stop_string_within_min_tokens_is_not_checked(url: str) -> None:
    """detokenizer.py:134-136: strings are checked once the output has more than min_tokens
    tokens, and only where they end after the min_tokens'th token's text."""
    body = completion(stream=False, stop="quick")
    assert httpx.post(url + COMPLETIONS, json=body).json()["choices"][0]["text"] == " The "
    answer = httpx.post(url + COMPLETIONS, json={**body, "min_tokens": 2}).json()
    choice = answer["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (
        completion_text(8),
        "stop",
        None,
    )


def test_min_tokens_holds_back_the_eos(url: str) -> None:
    """v1/core/sched/utils.py check_stop: no stop before min_tokens tokens (the EOS is
    masked too: v1/sample/logits_processor/builtin.py MinTokensLogitsProcessor), so the
    EOS comes at the earliest as token 12, after 11 tokens of text."""
    body = completion(stream=False, min_tokens=11)
    answer = httpx.post(url + COMPLETIONS, json=body).json()
    assert answer["choices"][0]["text"] == completion_text(11)
    assert answer["usage"]["completion_tokens"] == 12
    assert answer["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"min_tokens": -1}, "min_tokens must be greater than or equal to 0, got -1."),
        (
            {"min_tokens": 6, "max_tokens": 5},
            "min_tokens must be less than or equal to max_tokens=5, got 6.",
        ),
    ],
)
def test_min_tokens_that_vllm_refuses_is_its_400(
    url: str, extra: dict[str, Any], message: str
) -> None:
    """vllm/sampling_params.py:694-702."""
    r = httpx.post(url + CHAT, json=chat(stream=False, **extra))
    assert r.status_code == 400 and r.json()["error"]["message"] == message


# -- a script cut by its token limit ----------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "kinds"),
    [
        ({"x-sim-reasoning-tokens": "3"}, ["reasoning", "reasoning"]),
        ({"x-sim-tool-calls": "1", "x-sim-output-tokens": "1"}, ["content", "tool_calls"]),
        ({"x-sim-reasoning-tokens": "1", "x-sim-output-tokens": "4"}, ["reasoning", "content"]),
    ],
    ids=["in_reasoning", "in_a_call", "in_the_answer"],
)
def test_a_script_cut_by_its_limit_ends_on_its_last_tokens_chunk(
    client: httpx.Client, url: str, headers: dict[str, str], kinds: list[str]
) -> None:
    """chat_completion/serving.py:752-792: the finish rides on the output that ends the
    choice, whatever the parsers made of its delta."""
    got = read_events(client, url, chat(max_tokens=2), headers)
    chunks = [e.json["choices"][0] for e in got.events[1:-1]]  # after the role chunk
    assert [next(k for k in c["delta"] if c["delta"][k]) for c in chunks] == kinds
    assert [c["finish_reason"] for c in chunks] == [None, "length"]


@pytest.mark.parametrize(
    "headers",
    [{"x-sim-tool-calls": "1"}, {"x-sim-reasoning-tokens": "3"}],
    ids=["calls", "reasoning"],
)
def test_a_script_is_for_streams_only(url: str, headers: dict[str, str]) -> None:
    """docs/reasoning.md: a body answered `finish_reason: "tool_calls"` with no call in it
    (and counted reasoning it never carried): now the headers leave a body as it was."""
    r = httpx.post(url + CHAT, json=chat(stream=False), headers=headers)
    plain = httpx.post(url + CHAT, json=chat(stream=False))
    choice = r.json()["choices"][0]
    assert (choice["finish_reason"], choice["message"].get("tool_calls")) == ("stop", None)
    assert choice["message"] == plain.json()["choices"][0]["message"]
    assert r.json()["usage"] == plain.json()["usage"]


def test_a_script_that_ends_with_tool_calls_finishes_on_a_chunk_of_its_own(
    client: httpx.Client, url: str
) -> None:
    """The EOS after the last call is its own output, with no delta for the parser to
    give: a chunk with the finish, "tool_calls" as tools were streamed (serving.py:768-776)."""
    headers = {"x-sim-tool-calls": "1", "x-sim-output-tokens": "0"}
    got = read_events(client, url, chat(), headers)
    last_call, finish = (e.json["choices"][0] for e in got.events[-3:-1])
    assert (bool(last_call["delta"].get("tool_calls")), last_call["finish_reason"]) == (True, None)
    assert finish["finish_reason"] == "tool_calls"


# -- n choices take n of --max-num-seqs ---------------------------------------------------


def test_n_choices_take_n_slots_of_max_num_seqs() -> None:
    """vLLM runs each of n choices as a child request (v1/engine/async_llm.py ParentRequest,
    v1/engine/parallel_sampling.py), each a sequence of the scheduler's: n=2 fills two
    slots, so a third request waits; n over the slots there are runs, in all of them."""
    config = SimConfig(ttft=0.0, tokens_per_second=1000.0, output_tokens=4, max_num_seqs=2)
    with running(config) as (server, app):
        state, target = app.state, server.url + CHAT
        hold = {"x-sim-output-tokens": "5000"}  # 5 s: held until the client leaves
        with httpx.stream("POST", target, json=chat(n=2), headers=hold) as first:
            chunks = first.iter_raw()
            next(chunks)  # it streams: it has its slots
            with httpx.Client(timeout=30) as c, ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(c.post, target, json=chat(stream=False))
                assert state.wait_for(lambda: len(state.requests()) == 2)
                assert state.wait_for(lambda: state.requests()[1].queued_at is not None)
                time.sleep(0.1)
                assert state.requests()[1].scheduled_at is None  # no slot left for it
                first.close()
                assert waiting.result().is_success
        many = httpx.post(target, json=chat(stream=False, n=3), timeout=30)
        assert len(many.json()["choices"]) == 3
