"""Stop words (`stop`) in the llama.cpp mode, on the native /completion and the
OpenAI-compatible chat and completions, as llama-server applies them (server-context.cpp
process_token; proxy/sim/llamacpp_words.py).

The captures tests/fixtures/streams/llamacpp/*stop* are the real binary's answers to a
grammar that forces " upon upon upon" (or " upon upon" then the EOS) with `"stop": ["on
u"]` (or `["on x"]`, a start that never completes). The simulator's text is its own
(" The quick brown ..."), so each request's words are replaced by ones that meet it the
same way: "e q" is held at " The" and completes in " The quick" as "on u" does in
" upon upon"; "e quick!" is held at both tokens as "on x" is.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import Running
from tests.sim.test_sim_llamacpp import events, skeleton

FIXTURES = Path(__file__).parent.parent / "fixtures" / "streams" / "llamacpp"
INDEX = orjson.loads((FIXTURES / "index.json").read_bytes())
#: The captures' words, and the simulator's words that meet its text the same way.
WORDS = {"on u": "e q", "on x": "e quick!"}
FAST = {"x-sim-ttft": "0.01", "x-sim-tps": "1000"}
NATIVE = {"prompt": "once upon", "n_predict": 8, "stream": True}


@pytest.fixture
def sim(start_sim: Callable[..., Running]) -> Running:
    return start_sim(models=("tiny",), backend_kind="llamacpp")


def text(event: Any) -> str | None:
    """The text a llama-server event or body carries, in any of its three shapes."""
    if "choices" not in event:
        return event.get("content")
    if not event["choices"]:
        return None
    choice = event["choices"][0]
    if "text" in choice:
        return choice["text"]
    return (choice.get("delta") or choice.get("message") or {}).get("content")


def counts(event: Any) -> list[int]:
    got = [event.get("tokens_predicted"), (event.get("usage") or {}).get("completion_tokens")]
    got.append((event.get("timings") or {}).get("predicted_n"))
    return [n for n in got if n is not None]


def ask(sim: Running, name: str) -> tuple[Any, Any]:
    """The simulator's answer to a capture's request (its words replaced), and the capture."""
    request = INDEX["requests"][name]
    body = {**request["body"], "stop": [WORDS[w] for w in request["body"]["stop"]]}
    # the grammar's words: three where one completes, two then the EOS where none does
    tokens = "3" if request["body"]["stop"] == ["on u"] else "2"
    r = httpx.post(
        sim.url + request["path"], json=body, headers={**FAST, "x-sim-output-tokens": tokens}
    )
    assert r.status_code == request["status"] == 200
    real = (FIXTURES / name).read_bytes()
    if name.endswith(".json"):
        return orjson.loads(r.content), orjson.loads(real)
    return events(r.content), events(real)


STREAMS = [
    "native_completion_stop_stream.sse",
    "native_completion_stop_limit_stream.sse",
    "native_completion_stop_eos_stream.sse",
    "completions_stream_stop.sse",
    "completions_stream_stop_eos.sse",
    "chat_stream_stop.sse",
    "chat_stream_stop_eos.sse",
]


@pytest.mark.parametrize("name", STREAMS)
def test_stop_word_streams_are_the_real_servers(sim: Running, name: str) -> None:
    """Event for event: the same members (`timings` on the partial that completes the
    word), the same events with and without text, the same counts."""
    got, want = ask(sim, name)
    assert [skeleton(e) for e in got] == [skeleton(e) for e in want]
    objects = [(e, w) for e, w in zip(got, want, strict=True) if isinstance(e, dict)]
    assert [bool(text(e)) for e, _ in objects] == [bool(text(w)) for _, w in objects]
    assert [counts(e) for e, _ in objects] == [counts(w) for _, w in objects]
    if name.startswith("native"):
        last, real = got[-1], want[-1]
        assert last["stop_type"] == real["stop_type"]
        assert last["stopping_word"] == WORDS.get(real["stopping_word"], "")
        assert last["tokens_cached"] == real["tokens_cached"]


@pytest.mark.parametrize(
    "name", ["native_completion_stop.json", "native_completion_stop_limit.json", "chat_stop.json"]
)
def test_stop_word_bodies_are_the_real_servers(sim: Running, name: str) -> None:
    got, want = ask(sim, name)
    assert skeleton(got) == skeleton(want)
    assert counts(got) == counts(want)
    if "stop_type" in want:
        assert (got["stop_type"], got["tokens_cached"]) == (
            want["stop_type"],
            want["tokens_cached"],
        )
    else:
        assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"] == "stop"


def test_the_text_is_cut_before_the_word_and_held_text_is_sent_with_it(sim: Running) -> None:
    got = events(
        httpx.post(sim.url + "/completion", json={**NATIVE, "stop": ["e q"]}, headers=FAST).content
    )
    assert [e["content"] for e in got] == ["", " Th", ""]
    assert [e["tokens_predicted"] for e in got] == [1, 2, 2]  # no EOS after a word
    assert ("timings" in got[1], got[1]["timings"]["predicted_n"]) == (True, 2)


def test_held_text_a_limit_cuts_is_lost_only_when_streamed(sim: Running) -> None:
    body = {**NATIVE, "n_predict": 1, "stop": ["e q"]}
    streamed = events(httpx.post(sim.url + "/completion", json=body, headers=FAST).content)
    whole = httpx.post(sim.url + "/completion", json={**body, "stream": False}, headers=FAST)
    assert [e["content"] for e in streamed] == ["", ""]
    assert (whole.json()["content"], whole.json()["stop_type"]) == (" The", "limit")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/completion", {"prompt": "once upon"}),
        ("/v1/completions", {"prompt": "once upon"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_a_string_is_one_word_and_the_finish_is_stop(
    sim: Running, path: str, body: dict[str, Any]
) -> None:
    r = httpx.post(sim.url + path, json={**body, "stop": "quick"}, headers=FAST)
    answer = r.json()
    assert text(answer) == " The "
    if path == "/completion":
        assert (answer["stop_type"], answer["stopping_word"]) == ("word", "quick")
        assert answer["generation_settings"]["stop"] == ["quick"]
    else:
        assert answer["choices"][0]["finish_reason"] == "stop"
        assert answer["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("path", ["/completion", "/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    ("word", "kind"), [(5, "number"), (True, "boolean"), (["a"], "array"), ({"a": 1}, "object")]
)
def test_a_word_that_is_no_string_is_the_real_servers_400(
    sim: Running, path: str, word: Any, kind: str
) -> None:
    body = {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}
    r = httpx.post(sim.url + path, json={**body, "stop": [None, [], {}, word]}, headers=FAST)
    assert r.status_code == 400
    assert r.json() == {
        "error": {
            "code": 400,
            "message": "Field 'stop': [json.exception.type_error.302] type must be string, "
            f"but is {kind}",
            "type": "invalid_request_error",
        }
    }


def test_each_prompt_of_a_list_stops_with_its_own_timings(sim: Running) -> None:
    body = {**NATIVE, "prompt": ["a", "a much longer prompt"], "stop": ["e q"]}
    got = events(httpx.post(sim.url + "/completion", json=body, headers=FAST).content)
    partials = [e for e in got[1:] if e is not None and not e["stop"]]
    assert [(e["index"], e["content"]) for e in partials] == [
        (0, ""),
        (1, ""),
        (0, " Th"),
        (1, " Th"),
    ]
    assert [e["timings"]["prompt_n"] for e in partials[2:]] == [
        e["tokens_evaluated"] for e in partials[2:]
    ]
    assert [e["stopping_word"] for e in got[-2:]] == ["e q", "e q"]


def test_a_vllm_simulator_keeps_vllms_stop_strings(start_sim: Callable[..., Running]) -> None:
    sim = start_sim(models=("tiny",))
    body = {"model": "tiny", "prompt": "x", "stop": "quick"}
    choice = httpx.post(sim.url + "/v1/completions", json=body, headers=FAST).json()["choices"][0]
    assert (choice["text"], choice["stop_reason"]) == (" The ", "quick")
