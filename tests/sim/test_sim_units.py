"""The simulator's I/O-free parts: tokens, request plans, wire templates, config, CLI, state."""

from __future__ import annotations

import json
import threading
import time
from typing import get_args

import pytest

from proxy.sim import SimConfig, SimRequest, SimState, completion_text, errors, wire
from proxy.sim.app import _WRITERS
from proxy.sim.cli import parse
from proxy.sim.controls import REQUESTS, Kind, Plan, plan_request
from proxy.sim.tokens import VOCAB, count_prompt_tokens, text_json

# -- tokens ----------------------------------------------------------------------


def test_completion_text_cycles_the_vocabulary() -> None:
    assert completion_text(3) == VOCAB[0] + VOCAB[1] + VOCAB[2]
    assert completion_text(2, start=len(VOCAB)) == completion_text(2)


def test_vocabulary_has_multibyte_and_escaped_tokens() -> None:
    widths = {len(ch.encode()) for token in VOCAB for ch in token}
    assert {1, 3, 4} <= widths
    assert any('"' in t for t in VOCAB) and any("\n" in t for t in VOCAB)


@pytest.mark.parametrize("count", [1, 2, 5, 40])
@pytest.mark.parametrize("start", [0, 7, 13])
def test_text_json_is_the_json_escaped_text(count: int, start: int) -> None:
    text = completion_text(count, start)
    assert json.loads(b'"' + text_json(count, start) + b'"') == text


@pytest.mark.parametrize(
    ("body", "tokens"),
    [
        ({"messages": [{"role": "user", "content": "12345678"}]}, 2),
        ({"messages": [{"role": "user", "content": "123456789"}]}, 3),
        (
            {
                "messages": [
                    {"role": "system", "content": "1234"},
                    {"role": "user", "content": "5678"},
                ]
            },
            2,
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "12345"}, {"type": "image_url"}],
                    }
                ]
            },
            2,
        ),
        ({"messages": []}, 1),
        ({"prompt": "1234"}, 1),
        ({"prompt": ["1234", "5678"]}, 2),
        ({"prompt": [1, 2, 3]}, 3),
        ({"prompt": [[1, 2], [3]]}, 3),
        ({"input": "12345678"}, 2),
        # Anthropic Messages: `system` (a string or text blocks) is read too
        ({"system": "1234", "messages": [{"role": "user", "content": "5678"}]}, 2),
        ({"system": [{"type": "text", "text": "12345678"}], "messages": []}, 2),
        # Responses: `instructions` and input items with input_text parts
        ({"instructions": "1234", "input": "5678"}, 2),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_text", "text": "12345678"}]},
                    {"role": "user", "content": "1234"},
                ]
            },
            3,
        ),
    ],
)
def test_prompt_tokens_are_a_quarter_of_the_characters(
    body: dict[str, object], tokens: int
) -> None:
    assert count_prompt_tokens(body) == tokens


# -- plans -----------------------------------------------------------------------

CONFIG = SimConfig(ttft=0.5, tokens_per_second=10, output_tokens=20, max_model_len=100)
BODY = {"model": "sim-model", "messages": [{"role": "user", "content": "x" * 40}]}


def plan(body: object = BODY, **headers: str) -> Plan:
    result = plan_request(
        "chat", body, {k.replace("_", "-"): v for k, v in headers.items()}, CONFIG
    )
    assert isinstance(result, Plan), result
    return result


def error(body: object = BODY, **headers: str) -> errors.ErrorReply:
    result = plan_request(
        "chat", body, {k.replace("_", "-"): v for k, v in headers.items()}, CONFIG
    )
    assert isinstance(result, errors.ErrorReply), result
    return result


def test_plan_defaults_come_from_the_config() -> None:
    p = plan()
    assert (p.ttft, p.tokens_per_second, p.output_tokens, p.finish_reason) == (0.5, 10, 20, "stop")
    assert (p.prompt_tokens, p.stream, p.include_usage, p.fault) == (10, False, False, None)


def test_headers_override_the_config() -> None:
    p = plan(x_sim_ttft="0.1", x_sim_tps="99", x_sim_output_tokens="3", x_sim_tokens_per_chunk="2")
    assert (p.ttft, p.tokens_per_second, p.output_tokens, p.tokens_per_chunk) == (0.1, 99, 3, 2)


def test_output_is_cut_to_what_the_context_has_left() -> None:
    p = plan({**BODY, "messages": [{"role": "user", "content": "x" * 360}]})
    assert (p.output_tokens, p.finish_reason) == (10, "length")


def test_prompt_filling_the_context_is_vllms_400() -> None:
    reply = error({**BODY, "messages": [{"role": "user", "content": "x" * 400}]})
    assert reply.status == 400
    assert b"However, your prompt contains 100 input tokens" in reply.body


def test_forced_context_length_error_has_consistent_numbers() -> None:
    body = json.loads(error(x_sim_error="context_length").body)
    assert body["error"]["message"].startswith(
        "This model's maximum context length is 100 tokens. However, you requested 101 tokens "
        "(10 in the messages, 91 in the completion)."
    )


@pytest.mark.parametrize(
    ("headers", "needle"),
    [
        ({"x_sim_ttft": "soon"}, "x-sim-ttft"),
        ({"x_sim_tps": "0"}, "x-sim-tps"),
        ({"x_sim_output_tokens": "-1"}, "x-sim-output-tokens"),
        ({"x_sim_error": "nope"}, "x-sim-error"),
        ({"x_sim_usage_mode": "sometimes"}, "x-sim-usage-mode"),
    ],
)
def test_bad_control_headers_are_400s_naming_the_header(
    headers: dict[str, str], needle: str
) -> None:
    reply = error(**headers)
    assert reply.status == 400 and needle in json.loads(reply.body)["error"]["message"]


@pytest.mark.parametrize("body", [[], {"model": "sim-model"}, {**BODY, "max_tokens": 0}])
def test_malformed_requests_are_400s(body: object) -> None:
    assert error(body).status == 400


def test_cached_tokens_are_clamped_to_the_prompt() -> None:
    assert plan(x_sim_cached_tokens="1000").cached_tokens == 10


def test_cached_tokens_default_from_the_config_and_absent_when_zero() -> None:
    assert plan().cached_tokens is None  # chat usage then carries no details, like vLLM
    with_cache = plan_request("chat", BODY, {}, SimConfig(cached_tokens=4))
    assert isinstance(with_cache, Plan) and with_cache.cached_tokens == 4
    assert plan(x_sim_cached_tokens="0").cached_tokens == 0


def test_ttft_grows_per_prompt_token_from_config_or_header() -> None:
    config = SimConfig(ttft=0.5, ttft_per_prompt_token=0.01)
    p = plan_request("chat", BODY, {}, config)  # 10 prompt tokens
    assert isinstance(p, Plan) and p.ttft == pytest.approx(0.6)
    assert plan(x_sim_ttft_per_prompt_token="0.1").ttft == pytest.approx(1.5)


def test_cpu_per_token_is_planned_in_seconds() -> None:
    assert plan().cpu_per_token == 0
    assert plan(x_sim_cpu_per_token_us="250").cpu_per_token == pytest.approx(0.00025)


@pytest.mark.parametrize("name", ["ttft_per_prompt_token", "cached_tokens", "cpu_per_token_us"])
def test_negative_knobs_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        SimConfig(**{name: -1})


def test_messages_and_responses_read_their_own_limits_and_fields() -> None:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "x" * 40}]}
    messages = plan_request("messages", {**body, "max_tokens": 5}, {}, CONFIG)
    assert isinstance(messages, Plan) and messages.output_tokens == 5
    assert messages.finish_reason == "length"
    missing = plan_request("messages", body, {}, CONFIG)  # Anthropic requires max_tokens
    assert isinstance(missing, errors.ErrorReply) and missing.status == 400
    responses = plan_request(
        "responses", {"model": "sim-model", "input": "hi", "max_output_tokens": 3}, {}, CONFIG
    )
    assert isinstance(responses, Plan) and (responses.output_tokens, responses.max_tokens) == (3, 3)
    unlimited = plan_request("responses", {"model": "sim-model", "input": "hi"}, {}, CONFIG)
    assert isinstance(unlimited, Plan) and unlimited.token_limit == 99  # context left


def test_messages_errors_are_translated_to_anthropic_shape() -> None:
    body = {"model": "nope", "max_tokens": 5, "messages": []}
    reply = plan_request("messages", body, {}, CONFIG)
    assert isinstance(reply, errors.ErrorReply) and reply.status == 404
    assert json.loads(reply.body) == {
        "type": "error",
        "error": {"type": "NotFoundError", "message": "The model `nope` does not exist."},
    }
    # Bodies vLLM never translates stay as they are.
    assert errors.anthropic_error(errors.unauthorized()) == errors.unauthorized()
    html = errors.forced_error(
        "html_502", model="m", max_model_len=1, prompt_tokens=1, max_tokens=None
    )
    assert errors.anthropic_error(html) == html


# -- wire ------------------------------------------------------------------------


def event_json(event: bytes) -> dict[str, object]:
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    result: dict[str, object] = json.loads(event[6:-2])
    return result


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("stamp", wire.STAMPS)
def test_every_template_event_is_one_valid_json_event(chat: bool, stamp: str) -> None:
    sse = wire.StreamWire(chat, 'id"1', 1700000000, "m\\odel", stamp)
    usage = wire.usage_json(3, 4, 2)
    events = [
        sse.role(),
        sse.role(usage),
        sse.content(text_json(5)),
        sse.content(text_json(5), usage),
        sse.finish("length"),
        sse.finish("stop", usage),
        sse.usage(usage),
    ]
    for event in events:
        assert event.count(b"\n\n") == 1
        data = event_json(event)
        assert data["id"] == 'id"1' and data["model"] == "m\\odel" and data["created"] == 1700000000
    assert (next(iter(event_json(events[2]))) == "sent_ns") is (stamp == "key")
    text = event_json(events[2])["choices"][0]["delta" if chat else "text"]
    text = text["content"] if chat else text
    assert text.startswith("@") is (stamp == "text")
    assert event_json(events[6])["usage"] == {
        "prompt_tokens": 3,
        "total_tokens": 7,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 2},
    }


def test_error_event_is_vllms_shape() -> None:
    error = event_json(wire.ERROR_EVENT)["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}


def test_full_completion_is_valid_json_with_usage() -> None:
    body = json.loads(
        wire.full_completion(True, "c1", 1, "m", 'a"b', "stop", wire.usage_json(1, 2, None))
    )
    assert body["choices"][0]["message"]["content"] == 'a"b'
    assert body["usage"] == {"prompt_tokens": 1, "total_tokens": 3, "completion_tokens": 2}


# -- config and CLI --------------------------------------------------------------


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="tokens_per_second"):
        SimConfig(tokens_per_second=0)
    with pytest.raises(ValueError, match="models"):
        SimConfig(models=())


@pytest.mark.parametrize(
    ("configured", "in_text", "header", "mode"),
    [
        (False, False, "", ""),
        (False, False, "0", ""),
        (False, False, "1", "key"),
        (False, False, "true", "key"),
        (False, False, "text", "text"),
        (True, False, "", "key"),
        (True, False, "text", "text"),
        (True, True, "", "text"),
        (True, True, "1", "key"),  # the request's header says which
        (False, True, "", ""),  # stamp_in_text says where, not whether
    ],
)
def test_a_requests_stamp_is_its_header_else_the_config(
    configured: bool, in_text: bool, header: str, mode: str
) -> None:
    assert wire.stamp_mode(configured, in_text, header) == mode


def test_cli_reads_environment_and_flags_win() -> None:
    environ = {
        "TOKENPROBE_SIM_TTFT": "0.2",
        "TOKENPROBE_SIM_TPS": "80",
        "TOKENPROBE_SIM_MODEL": "a, b",
        "TOKENPROBE_SIM_STAMP": "true",
        "TOKENPROBE_SIM_PORT": "9000",
    }
    config, args = parse(["--tps", "90", "--step-ms", "15"], environ)
    assert config.ttft == 0.2 and config.tokens_per_second == 90 and config.step_ms == 15
    assert config.models == ("a", "b") and config.stamp is True
    assert config.stamp_in_text is False
    assert parse(["--stamp-in-text"], environ)[0].stamp_in_text is True
    assert parse([], {**environ, "TOKENPROBE_SIM_STAMP_IN_TEXT": "1"})[0].stamp_in_text is True
    assert (args.host, args.port) == ("127.0.0.1", 9000)
    config, _ = parse(["--model", "x", "--model", "y", "--api-key", "k"], environ)
    assert config.models == ("x", "y") and config.api_key == ("k",)  # vLLM's list of keys


@pytest.mark.parametrize(
    "environ",
    [
        {"TOKENPROBE_SIM_TTFT": "soon"},
        {"TOKENPROBE_SIM_STAMP": "maybe"},  # was read as false, where serve refuses it
        {"TOKENPROBE_SIM_PORT": "70000"},  # the socket took it modulo 65536: port 4464
    ],
)
def test_cli_names_the_bad_environment_variable(
    capsys: pytest.CaptureFixture[str], environ: dict[str, str]
) -> None:
    with pytest.raises(SystemExit):
        parse([], environ)
    assert next(iter(environ)) in capsys.readouterr().err


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_a_port_out_of_range_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], port: str
) -> None:
    from proxy.demo import main as demo

    with pytest.raises(SystemExit) as exited:
        parse(["--port", port], {})
    assert exited.value.code == 2 and "--port" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # the demo's too (it was a traceback)
        demo(["--port", port])
    assert exited.value.code == 2 and "--port" in capsys.readouterr().err


# -- state -----------------------------------------------------------------------


def record() -> SimRequest:
    return SimRequest("r1", "/v1/x", "POST", {"authorization": "Bearer k"}, None, time.monotonic())


def test_wait_for_wakes_on_a_lifecycle_step_from_another_thread() -> None:
    state = SimState()
    r = record()
    state.begin(r)
    timer = threading.Timer(0.05, state.end, (r, "completed"))
    timer.start()
    t0 = time.monotonic()
    assert state.wait_for(lambda: r.outcome == "completed", timeout=2)
    assert time.monotonic() - t0 < 1
    assert state.active == 0 and state.max_active == 1


def test_wait_for_returns_false_on_timeout() -> None:
    assert SimState().wait_for(lambda: False, timeout=0.05) is False


def test_state_keeps_at_most_max_records_and_resets() -> None:
    state = SimState(max_records=2)
    for _ in range(3):
        state.begin(record())
    assert len(state.requests()) == 2 and state.total == 3
    state.reset()
    assert state.requests() == [] and state.last() is None and state.active == 3


def test_record_json_masks_the_authorization_header() -> None:
    assert record().to_json()["headers"] == {"authorization": "***"}


def test_record_json_masks_every_credential_and_keeps_controls_and_counts() -> None:
    headers = {
        "x-api-key": "CANARY1",
        "api-key": "CANARY2",
        "cookie": "session=CANARY3",
        "x-goog-api-key": "CANARY4",
        "proxy-authorization": "Basic CANARY5",
        "x-sim-output-tokens": "40",  # the simulator's own control, not a credential
        "x-trace": "t1",
    }
    body = {
        "model": "m",
        "max_tokens": 5,  # a count under a name with `token` in it
        "prompt_token_ids": [1, 2],
        "api_key": "CANARY6",
        "credentials": {"user": "u", "pin": "CANARY7"},
        "messages": [{"role": "user", "content": "hi", "secret": "CANARY8"}],
        "code": "print(1)",  # a body's `code` is no query's `?code=`
    }
    view = SimRequest("r1", "/v1/x", "POST", headers, body, time.monotonic()).to_json()
    assert view["headers"] == {
        **dict.fromkeys(list(headers)[:5], "***"),
        "x-sim-output-tokens": "40",
        "x-trace": "t1",
    }
    assert view["body"] == {
        **body,
        "api_key": "***",
        "credentials": "***",
        "messages": [{"role": "user", "content": "hi", "secret": "***"}],
    }
    # a GET's body is its query: `?key=`, `?sig=`, `?code=` carry a credential there
    query = {"api_key": "CANARY9", "key": "CANARY10", "sig": "CANARY11", "code": "CANARY12"}
    got = SimRequest("r2", "/v1/responses/r", "GET", {}, {**query, "stream": "true"}, 0.0)
    assert got.to_json()["body"] == {**dict.fromkeys(query, "***"), "stream": "true"}


def test_every_generation_kind_has_its_request_rules_and_its_writer() -> None:
    # The tables a new simulated API adds a line to; a kind missing from one would fail
    # only when a request for it arrived.
    kinds = set(get_args(Kind))
    assert set(REQUESTS) == kinds
    assert set(_WRITERS) == kinds


@pytest.mark.parametrize(
    ("kind", "body", "message"),
    [
        ("chat", {"model": "m"}, "Field required: messages"),
        ("cohere", {"messages": "hi"}, "Field required: messages"),
        ("messages", {"messages": []}, "Field required: max_tokens"),
        ("completion", {}, "Either prompt or prompt_embeds must be provided and non-empty."),
        ("responses", {}, "Field required: input"),
        ("generate", {"token_ids": []}, "Field required: token_ids"),
    ],
)
def test_each_kind_requires_what_vllm_requires(
    kind: Kind, body: dict[str, object], message: str
) -> None:
    reply = plan_request(kind, body, {}, SimConfig())
    assert isinstance(reply, errors.ErrorReply)
    assert reply.status == 400
    assert message.encode() in reply.body


@pytest.mark.parametrize(("kind", "anthropic"), [("messages", True), ("chat", False)])
def test_only_messages_answers_its_plan_errors_in_anthropics_shape(
    kind: Kind, anthropic: bool
) -> None:
    body = {"model": "nope", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    reply = plan_request(kind, body, {}, SimConfig())
    assert isinstance(reply, errors.ErrorReply)
    assert (json.loads(reply.body).get("type") == "error") is anthropic
