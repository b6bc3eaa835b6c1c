"""The access log: one stable line per request, and no secret anywhere the proxy writes."""

from __future__ import annotations

import io
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from proxy.core.engine import EngineMetrics
from proxy.core.fingerprint import of_prompt
from proxy.core.measurement import NONE_LABEL, ErrorType, Measurement
from proxy.core.toolcalls import ToolCall
from proxy.server.assemble import assemble
from proxy.settings import Settings
from proxy.sinks.logs import KEYS, AccessLog, iso_utc
from proxy.sinks.sink import Labels
from proxy.sinks.tracing import Tracing
from tests.conftest import MODEL, Running
from tests.factories import measurement
from tests.servers import ThreadedServer

ISO_MS_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def record(**changes: Any) -> Measurement:
    return measurement(
        **{
            "model": MODEL,
            "started_at": 1_700_000_000.1239,
            "ttfb": 0.0101234,
            "ttft": 0.05,
            "decode_tokens_per_second": 199.99999,
            "raw_finish_reason": "stop",
            "inter_token_latencies": (),
            "response_id": "chatcmpl-1",
            "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736",
            **changes,
        }
    )


def log_lines(mode: str, *records: Measurement) -> list[str]:
    out = io.StringIO()
    log = AccessLog(mode, out)
    for m in records:
        log.record(m, Labels(MODEL))
    return out.getvalue().splitlines(keepends=True)


# -- format -------------------------------------------------------------------------------


def test_json_mode_writes_one_object_per_line_with_the_documented_keys_in_order() -> None:
    lines = log_lines("json", record(), record(error_type=ErrorType.RATE_LIMIT))
    assert len(lines) == 2 and all(line.endswith("\n") for line in lines)
    for line in lines:
        assert tuple(orjson.loads(line)) == KEYS


def test_json_values_are_in_ms_with_nulls_for_unknowns() -> None:
    (line,) = log_lines("json", record())
    assert orjson.loads(line) == {
        "ts": "2023-11-14T22:13:20.123Z",
        "arrival": 1_700_000_000.1239,
        "model": MODEL,
        "endpoint": "/v1/chat/completions",
        "status": 200,
        "error_type": None,
        "finish_reason": "stop",
        "raw_finish_reason": "stop",
        "prompt_tokens": 12,
        "output_tokens": 16,
        "cached_tokens": None,
        "token_source": "usage",
        "cache_write_tokens": None,
        "ttfb_ms": 10.123,
        "ttft_ms": 50.0,
        "tpot_ms": 5.0,
        "decode_tps": 200.0,
        "e2e_ms": 125.0,
        "load_ms": None,
        "queue_ms": None,
        "engine_ttft_ms": None,
        "outside_engine_ms": None,
        "tokens_per_chunk": 1.0,
        "spec_draft_tokens": None,
        "spec_accepted_tokens": None,
        "proxy_overhead_ms": None,
        "stream": True,
        "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736",
        "response_id": "chatcmpl-1",
        "system_fingerprint": None,
        "error": None,
        "max_tokens": None,
        "prefix": None,
        "prefix_chars": None,
        "prompt_chars": None,
        "ttfa_ms": None,
        "reasoning_ms": None,
        "reasoning_tokens": None,
        "reasoning_token_source": None,
        "tool_calls": None,
        "without_answer": None,
        "conversation": None,
        "turn": None,
        "turn_gap_ms": None,
        "malformed_events": None,
    }


def test_cache_writes_and_the_system_fingerprint_are_logged_as_the_backend_said_them() -> None:
    m = record(
        cached_prompt_tokens=0, cache_write_tokens=128, system_fingerprint="vllm-0.32.0-51eb094b"
    )
    obj = orjson.loads(log_lines("json", m)[0])
    assert (obj["cached_tokens"], obj["cache_write_tokens"]) == (0, 128)
    assert obj["system_fingerprint"] == "vllm-0.32.0-51eb094b"
    (text,) = log_lines("text", m)
    assert " token_source=usage cache_write_tokens=128 ttfb_ms=" in text
    assert " response_id=chatcmpl-1 system_fingerprint=vllm-0.32.0-51eb094b\n" in text
    (unsaid,) = log_lines("text", record())
    assert "cache_write_tokens" not in unsaid and "system_fingerprint" not in unsaid


def test_a_reasoning_stream_logs_its_first_answer_reasoning_and_calls() -> None:
    m = record(
        first_reasoning=0.25,
        last_reasoning=1.25,
        first_answer=1.5,
        reasoning_tokens=40,
        reasoning_token_source="usage",
        tool_calls=(ToolCall("complete", 0.5), ToolCall("truncated", 0.25)),
    )
    obj = orjson.loads(log_lines("json", m)[0])
    assert (obj["ttfa_ms"], obj["reasoning_ms"], obj["ttft_ms"]) == (1500.0, 1000.0, 50.0)
    assert (obj["reasoning_tokens"], obj["reasoning_token_source"]) == (40, "usage")
    assert obj["tool_calls"] == {"complete": 1, "truncated": 1}
    (text,) = log_lines("text", m)
    assert " tool_calls.complete=1 tool_calls.truncated=1" in text


def test_a_continuation_logs_its_conversation_turn_and_gap() -> None:
    m = record(conversation_id="9f86d081884c7d65", turn=3, continued_via="messages", turn_gap=1.5)
    obj = orjson.loads(log_lines("json", m)[0])
    assert (obj["conversation"], obj["turn"], obj["turn_gap_ms"]) == ("9f86d081884c7d65", 3, 1500.0)
    text = log_lines("text", m)[0]
    assert "conversation=9f86d081884c7d65 turn=3 turn_gap_ms=1500.0" in text


def test_a_stream_with_events_that_were_no_json_says_how_many() -> None:
    """The OpenAI SDK fails on such an event and closes: the line's client_cancelled
    alone would hide that the backend broke the stream."""
    m = record(error_type=ErrorType.CLIENT_CANCELLED, malformed_events=2)
    obj = orjson.loads(log_lines("json", m)[0])
    assert (obj["error_type"], obj["malformed_events"]) == ("client_cancelled", 2)
    assert log_lines("text", m)[0].endswith(" malformed_events=2\n")


def test_failed_request_logs_its_error_type_and_message() -> None:
    m = record(
        status_code=502,
        finish_reason=NONE_LABEL,
        error_type=ErrorType.UPSTREAM_UNREACHABLE,
        error_message="connect failed",
    )
    obj = orjson.loads(log_lines("json", m)[0])
    assert (obj["error_type"], obj["finish_reason"], obj["error"]) == (
        "upstream_unreachable",
        None,
        "connect failed",
    )


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        (0.0, "1970-01-01T00:00:00.000Z"),
        (1_700_000_000.9999, "2023-11-14T22:13:20.999Z"),
        (time.time(), None),
    ],
    ids=["epoch", "rounding", "now"],  # stable ids: parallel workers must collect alike
)
def test_timestamps_are_iso8601_utc_with_milliseconds(seconds: float, expected: str | None) -> None:
    stamp = iso_utc(seconds)
    assert ISO_MS_UTC.match(stamp)
    if expected is not None:
        assert stamp == expected


def test_text_mode_is_one_logfmt_line_without_nulls() -> None:
    (line,) = log_lines("text", record(model="my model", cached_prompt_tokens=None))
    assert line == (
        'ts=2023-11-14T22:13:20.123Z arrival=1700000000.1239 model="my model" endpoint=/v1/chat/completions status=200 '
        "finish_reason=stop raw_finish_reason=stop prompt_tokens=12 output_tokens=16 token_source=usage ttfb_ms=10.123 "
        "ttft_ms=50.0 tpot_ms=5.0 decode_tps=200.0 e2e_ms=125.0 tokens_per_chunk=1.0 stream=true "
        "trace_id=4bf92f3577b34da6a3ce929d0e0e4736 response_id=chatcmpl-1\n"
    )


@pytest.mark.parametrize("mode", ["json", "text"])
@pytest.mark.parametrize("newline", ["\n", "\r", "\u2028", "\u2029", "\x85"])
def test_a_newline_in_client_input_cannot_forge_a_line(mode: str, newline: str) -> None:
    """Any of the line breaks a reader may split on (str.splitlines splits on U+2028,
    U+2029 and U+0085 too; JSON leaves those unescaped)."""
    lines = log_lines(mode, record(model=f'x{newline}ts=forged "'))
    assert len(lines) == 1, lines
    if mode == "json":
        assert orjson.loads(lines[0])["model"] == f'x{newline}ts=forged "'


def prefixed(salt: str | None, messages: list[dict[str, Any]]) -> dict[str, Any]:
    out = io.StringIO()
    AccessLog("json", out, salt=salt).record(
        record(prefix=of_prompt(messages), max_tokens=64), Labels(MODEL)
    )
    return dict(orjson.loads(out.getvalue()))


SYSTEM = {"role": "system", "content": "You are the billing assistant of ACME Corp."}


def test_prefix_hashes_are_cumulative_and_shared_only_as_far_as_the_prompts_agree() -> None:
    a = prefixed("s", [SYSTEM, {"role": "user", "content": "refund order 12"}])
    b = prefixed("s", [SYSTEM, {"role": "user", "content": "where is order 7"}])
    assert a["max_tokens"] == 64 and len(a["prefix"]) == 2
    assert a["prefix"][0] == b["prefix"][0] and a["prefix"][1] != b["prefix"][1]
    assert a["prefix_chars"][0] == b["prefix_chars"][0] == len(orjson.dumps(SYSTEM))
    assert a["prompt_chars"] == a["prefix_chars"][1]
    assert all(re.fullmatch(r"[0-9a-f]{16}", h) for h in a["prefix"])


def test_prefix_hashes_depend_on_the_salt_and_show_no_content() -> None:
    messages = [SYSTEM, {"role": "user", "content": "hello"}]
    one, again, other = prefixed("s1", messages), prefixed("s1", messages), prefixed("s2", messages)
    assert one["prefix"] == again["prefix"] and one["prefix"] != other["prefix"]
    random_a, random_b = prefixed(None, messages), prefixed(None, messages)
    assert random_a["prefix"] != random_b["prefix"]  # a random salt per log
    line = orjson.dumps(one).decode()
    assert "ACME" not in line and "hello" not in line and "s1" not in line


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="json or text"):
        AccessLog("xml")


# -- no secret anywhere -------------------------------------------------------------------


class Observed:
    def __init__(self, url: str, log: io.StringIO, spans: InMemorySpanExporter) -> None:
        self.url = url
        self.log = log
        self.spans = spans


@pytest.fixture
def observed(sim: Running) -> Iterator[Observed]:
    log, spans = io.StringIO(), InMemorySpanExporter()
    tracing = Tracing([SimpleSpanProcessor(spans)], upstream=sim.url)
    app = assemble(
        Settings(upstream=sim.url, models_refresh=None, model_allowlist=(MODEL,), access_log="off"),
        {},
        registry=CollectorRegistry(),
        tracer=tracing,
        extra_sinks=[AccessLog("json", log)],
    )
    server = ThreadedServer(app, server_header=False, date_header=False).start()
    try:
        yield Observed(server.url, log, spans)
    finally:
        server.stop()
        tracing.shutdown()


def wait_lines(log: io.StringIO, n: int, timeout: float = 5.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while len(lines := log.getvalue().splitlines()) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return lines


def test_a_real_request_logs_one_line_that_matches_its_span(observed: Observed) -> None:
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(observed.url + "/v1/chat/completions", json=body).status_code == 200
    (line,) = wait_lines(observed.log, 1)
    obj = orjson.loads(line)
    (span,) = observed.spans.get_finished_spans()
    assert obj["trace_id"] == format(span.context.trace_id, "032x")
    assert (obj["status"], obj["finish_reason"], obj["token_source"]) == (200, "stop", "usage")
    assert obj["output_tokens"] == 17 and obj["ttft_ms"] >= 50.0  # 16 text tokens and the EOS


def test_secrets_in_headers_reach_no_log_span_or_metric(observed: Observed) -> None:
    headers = {
        "Authorization": "Bearer sk-SECRET123",
        "api-key": "sk-SECRET123",
        "Cookie": "session=sk-SECRET123",
        "x-api-key": "sk-SECRET123",
    }
    for stream in (True, False):
        body = {"model": MODEL, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
        response = httpx.post(observed.url + "/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 200
    wait_lines(observed.log, 2)
    spans = observed.spans.get_finished_spans()
    assert len(spans) == 2
    assert "SECRET123" not in observed.log.getvalue()
    for span in spans:
        assert "SECRET123" not in span.to_json()
    for accept in ("text/plain", "application/openmetrics-text"):
        metrics = httpx.get(observed.url + "/metrics", headers={"Accept": accept}).text
        assert "tokenprobe_requests_total" in metrics
        assert "SECRET123" not in metrics


def test_a_key_in_the_model_field_reaches_no_log_or_span(observed: Observed) -> None:
    """A key pasted into the wrong field is a key still: masked in the access log and the
    span (name and gen_ai.request.model) as in an error message."""
    body = {"model": "sk-MODELKEYCANARY0123", "messages": [{"role": "user", "content": "hi"}]}
    httpx.post(observed.url + "/v1/chat/completions", json=body)
    (line,) = wait_lines(observed.log, 1)
    (span,) = observed.spans.get_finished_spans()
    assert orjson.loads(line)["model"] == "[redacted]"
    assert "MODELKEYCANARY" not in span.to_json()
    assert span.name.endswith("[redacted]")


def test_stream_is_what_the_client_asked_whatever_came_back(observed: Observed) -> None:
    """A streaming request the backend refused (an unknown model: a JSON 404) is still
    logged as a stream: `bench replay` replays each line as it was asked for."""
    for model, status in (("no-such-model", 404), (MODEL, 200)):
        body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(observed.url + "/v1/chat/completions", json=body).status_code == status
    lines = wait_lines(observed.log, 2)
    assert [(orjson.loads(line)["status"], orjson.loads(line)["stream"]) for line in lines] == [
        (404, True),
        (200, True),
    ]


# -- the model load beside the engine parts ----------------------------------------------


def test_a_cold_ollama_model_logs_its_load_beside_the_engine_parts(observed: Observed) -> None:
    # Ollama's load_duration (the simulator's programmed load) is load_ms, not "outside"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"x-sim-load-time": "0.3", "x-sim-ttft": "0.05"}
    answer = httpx.post(observed.url + "/api/chat", json=body, headers=headers)
    assert answer.status_code == 200
    done = orjson.loads(answer.content.rstrip(b"\n").rsplit(b"\n", 1)[-1])
    warm = httpx.post(observed.url + "/api/chat", json={**body, "stream": False})
    assert warm.status_code == 200
    cold, loaded = (orjson.loads(line) for line in wait_lines(observed.log, 2))
    assert cold["load_ms"] == round(done["load_duration"] / 1e6, 3) and cold["load_ms"] >= 300
    assert cold["engine_ttft_ms"] == round(done["prompt_eval_duration"] / 1e6, 3)
    parts = cold["load_ms"] + cold["engine_ttft_ms"] + cold["outside_engine_ms"]
    assert abs(parts - cold["ttft_ms"]) <= 0.003  # each part rounded to the microsecond
    assert cold["queue_ms"] is None
    # not streamed, the model already loaded: the engine's own (tiny) load, no split
    assert loaded["load_ms"] == round(orjson.loads(warm.content)["load_duration"] / 1e6, 3)
    assert loaded["load_ms"] < 300 and loaded["outside_engine_ms"] is None


def test_an_engine_load_time_is_logged_and_scaled_with_the_split() -> None:
    engine = EngineMetrics(
        queue_time=None,
        time_to_first_token=0.1,
        generation_time=None,
        mean_itl=None,
        tokens_per_second=None,
        spec=None,
        load_time=0.5,
    )
    obj = orjson.loads(log_lines("json", record(ttft=0.65, engine=engine))[0])
    assert (obj["load_ms"], obj["engine_ttft_ms"], obj["outside_engine_ms"]) == (500.0, 100.0, 50.0)
    # the engine's parts above what the client saw are scaled down together, as in the
    # metrics (proxy/core/engine.py load_split), so the line still adds up
    obj = orjson.loads(log_lines("json", record(ttft=0.3, engine=engine))[0])
    assert obj["load_ms"] == 250.0 and obj["load_ms"] + obj["engine_ttft_ms"] == 300.0
    assert "load_ms=500.0" in log_lines("text", record(ttft=0.65, engine=engine))[0]
