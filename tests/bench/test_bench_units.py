"""The benchmark client's pure parts: flags, prompts, statistics, histogram quantiles, report."""

from __future__ import annotations

import math
from pathlib import Path

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.bench import compare, report
from proxy.bench.client import Result, prepare
from proxy.bench.load import Level
from proxy.bench.options import ENDPOINTS, Options, OptionsError, parse, parse_slo
from proxy.bench.prompts import BUILTIN, Prompt, PromptError, load_file, synthetic
from proxy.bench.stats import distribution, meets, quantile, summarize
from proxy.core.apis import APIS, api_for
from proxy.core.buckets import TTFT_BUCKETS
from proxy.core.measurement import ErrorType, Measurement
from proxy.core.request import CHAT, COMPLETIONS
from proxy.core.tokens import count_prompt, load_tokenizer
from proxy.core.wsseam import WS_APIS
from tests import factories
from tests.tokenizers_local import build_tiny_tokenizer

BASE = ["--url", "http://127.0.0.1:8000/v1", "--model", "m"]


def options(*flags: str, env: dict[str, str] | None = None) -> Options:
    return parse([*BASE, *flags], env or {})


def measurement(**overrides: object) -> Measurement:
    """40 tokens of model "m": the first at 0.2 s, 50 tokens/s after it, 1 s in all."""
    return factories.measurement(
        **{
            "model": "m",
            "started_at": 0.0,
            "ttft": 0.2,
            "tpot": 0.02,
            "decode_tokens_per_second": 50.0,
            "e2e": 1.0,
            "inter_token_latencies": (0.02, 0.02),
            "prompt_tokens": 10,
            "output_tokens": 40,
            "content_events": 40,
            "finish_reason": "length",
            **overrides,
        }
    )


def result(index: int = 0, **overrides: object) -> Result:
    return Result(0, index, 10.0, 10.0, measurement(**overrides))


# -- flags ------------------------------------------------------------------------------


def test_url_accepts_base_or_v1_and_builds_the_endpoint() -> None:
    assert options().url == "http://127.0.0.1:8000/v1/chat/completions"
    opts = parse(["--url", "http://h:1/", "--model", "m", "--endpoint", "completions"], {})
    assert opts.url == "http://h:1/v1/completions"


def test_concurrency_sweep_and_rate_are_two_load_shapes() -> None:
    closed = options("--concurrency", "1,4,16")
    assert (closed.mode, closed.levels, closed.requests) == ("closed", (1, 4, 16), 100)
    open_ = options("--rate", "2.5", "--duration", "30")
    assert (open_.mode, open_.levels, open_.requests, open_.duration) == (
        "open",
        (2.5,),
        None,
        30.0,
    )


def test_api_key_flag_wins_over_environment() -> None:
    assert options(env={"OPENAI_API_KEY": "env"}).api_key == "env"
    assert options("--api-key", "flag", env={"OPENAI_API_KEY": "env"}).api_key == "flag"


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--concurrency", "0"], "--concurrency"),
        (["--rate", "x"], "--rate"),
        (["--input-tokens", "10"], "--tokenizer"),
        (["--slo", "ttft=fast"], "--slo"),
        (["--slo", "latency=1"], "--slo"),
        (["--max-concurrency", "2"], "--max-concurrency"),
        (["--header", "no-colon"], "--header"),
    ],
)
def test_bad_flags_name_the_flag(flags: list[str], named: str) -> None:
    with pytest.raises(OptionsError, match=named):
        options(*flags)


def test_slo_parses_every_target() -> None:
    assert parse_slo("ttft=0.5, tpot=0.05,e2e=10") == {"ttft": 0.5, "tpot": 0.05, "e2e": 10.0}


# -- request bodies ---------------------------------------------------------------------


def test_request_streams_with_usage_at_temperature_zero() -> None:
    body = orjson.loads(prepare(options("--max-tokens", "7"), BUILTIN[0]).body)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["temperature"], body["max_tokens"], body["ignore_eos"]) == (0, 7, True)
    assert body["messages"] == [{"role": "user", "content": BUILTIN[0].text}]


def test_no_ignore_eos_omits_the_field_and_completions_send_a_prompt() -> None:
    opts = options("--no-ignore-eos", "--endpoint", "completions")
    body = orjson.loads(prepare(opts, Prompt(messages=({"role": "user", "content": "hi"},))).body)
    assert "ignore_eos" not in body and body["prompt"] == "hi"


# -- prompts ----------------------------------------------------------------------------


def test_builtin_prompts_mix_chinese_and_english_short_and_long() -> None:
    texts = [p.text or " ".join(m["content"] for m in p.messages or ()) for p in BUILTIN]
    assert any(any("\u4e00" <= c <= "\u9fff" for c in t) for t in texts)
    assert any(t.isascii() for t in texts)
    assert min(map(len, texts)) < 40 and max(map(len, texts)) > 250


def test_prompts_file_jsonl_and_plain_text(tmp_path: Path) -> None:
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a"}\n\n{"messages": [{"role": "user", "content": "b"}]}\n')
    assert load_file(str(jsonl)) == [
        Prompt("a"),
        Prompt(messages=({"role": "user", "content": "b"},)),
    ]
    plain = tmp_path / "p.txt"
    plain.write_text("first line\nsecond {not json}\n")
    assert load_file(str(plain)) == [Prompt("first line"), Prompt("second {not json}")]


def test_prompts_file_errors_name_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(PromptError, match=r"bad\.jsonl:2"):
        load_file(str(bad))
    with pytest.raises(PromptError, match="cannot read"):
        load_file(str(tmp_path / "missing"))


def test_endpoint_choices_come_from_the_seams_and_keep_their_names() -> None:
    # Every name users have typed still works and points at the same API path.
    assert ENDPOINTS == {
        "chat": "/v1/chat/completions",
        "completions": "/v1/completions",
        "messages": "/v1/messages",
        "responses": "/v1/responses",
        "embeddings": "/v1/embeddings",
        "generate": "/inference/v1/generate",
        "transcriptions": "/v1/audio/transcriptions",
        "translations": "/v1/audio/translations",
        "cohere": "/cohere/v2/chat",
        "ollama-chat": "/api/chat",
        "ollama-generate": "/api/generate",
        "llamacpp-completion": "/completion",
        "realtime": "/v1/realtime",
    }
    named = [api.bench_name for api in (*APIS, *WS_APIS) if api.bench_name]
    assert len(named) == len(set(named)), "two seams share a bench_name"
    for name, path in ENDPOINTS.items():
        assert options("--endpoint", name).endpoint == path


@pytest.mark.parametrize(
    ("endpoint", "messages"),
    [(api.endpoint, api.takes_messages) for api in APIS if api.bench_name],
)
def test_a_prompt_takes_the_shape_its_seam_says(endpoint: str, messages: bool) -> None:
    chat = [{"role": "user", "content": "hi"}]
    assert Prompt("hi").payload(endpoint) == (chat if messages else "hi")
    assert Prompt(messages=tuple(chat)).payload(endpoint) == (chat if messages else "hi")


@pytest.mark.parametrize("templated", [False, True], ids=["plain", "chat-template"])
@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_synthetic_prompts_have_exactly_n_tokens(
    tmp_path: Path, endpoint: str, templated: bool
) -> None:
    """Exactly as the tokenizer counts them, the chat template included where it has one:
    with transformers 5 a chat prompt once counted 2 (a BatchEncoding's keys), so no
    prompt of 50 could be built for a tokenizer with a template."""
    tokenizer = load_tokenizer(str(build_tiny_tokenizer(tmp_path)))
    if templated:
        tokenizer.chat_template = (
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}"
        )
    prompts = synthetic(tokenizer, 50, 5, endpoint, seed=1)
    assert len(set(prompts)) == 5
    assert [count_prompt(tokenizer, p.payload(endpoint)) for p in prompts] == [50] * 5
    if templated and endpoint == CHAT:  # as the template itself renders them
        for prompt in prompts:
            payload = prompt.payload(endpoint)
            ids = tokenizer.apply_chat_template(
                payload, add_generation_prompt=True, return_dict=False
            )
            assert len(ids) == 50


# -- statistics -------------------------------------------------------------------------


@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_quantile_is_linear_interpolation_between_ranks(values: list[float], q: float) -> None:
    ordered = sorted(values)
    got = quantile(ordered, q)
    assert got is not None and ordered[0] <= got <= ordered[-1]
    rank = (len(ordered) - 1) * q / 100
    assert ordered[math.floor(rank)] <= got <= ordered[math.ceil(rank)]


def test_distribution_ignores_missing_values() -> None:
    d = distribution([None, 1.0, 2.0, 3.0, 4.0])
    assert (d["mean"], d["p50"], d["max"]) == (2.5, 2.5, 4.0)
    assert distribution([None])["p99"] is None


def test_summary_keeps_ttft_decode_speed_and_throughput_apart() -> None:
    level = Level(0, 4, "c=4", start=0.0, end=2.0)
    level.results = [result(i) for i in range(4)]
    level.results.append(
        result(
            4, error_type=ErrorType.RATE_LIMIT, output_tokens=None, ttft=None, finish_reason="none"
        )
    )
    s = summarize(level, {"ttft": 0.25, "tpot": 0.05})
    assert (s.requests, s.ok, s.errors, s.truncated) == (5, 4, {"rate_limit": 1}, 4)
    assert s.ttft["p50"] == 0.2
    assert s.decode_tokens_per_second["p50"] == 50.0  # one stream
    assert s.output_throughput == 4 * 40 / 2.0  # all streams over the wall time
    assert (s.request_throughput, s.goodput, s.slo_met) == (2.0, 2.0, 4)


def test_slo_needs_every_target_met() -> None:
    assert meets(result(), {"ttft": 0.2, "tpot": 0.02})
    assert not meets(result(), {"ttft": 0.19})
    assert meets(result(tpot=None), {"tpot": 0.001})  # one-token answer: no TPOT to miss
    assert not meets(result(error_type=ErrorType.STREAM_ERROR), {})


# -- histogram quantiles ----------------------------------------------------------------


def cumulative(values: list[float]) -> list[tuple[float, float]]:
    bounds = (*TTFT_BUCKETS, math.inf)
    return [(b, float(sum(1 for v in values if v <= b))) for b in bounds]


def test_histogram_quantile_interpolates_like_promql() -> None:
    buckets = [(0.1, 10.0), (0.25, 30.0), (math.inf, 40.0)]
    assert compare.histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.15 * 10 / 20)
    assert compare.histogram_quantile(0.1, buckets) == pytest.approx(
        0.04
    )  # from 0 in the first bucket
    assert compare.histogram_quantile(0.25, buckets) == pytest.approx(0.1)
    assert compare.histogram_quantile(0.99, buckets) == 0.25  # in +Inf: the highest finite bound
    assert compare.histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None


@given(st.lists(st.floats(0.0005, 30), min_size=1, max_size=200), st.sampled_from([0.5, 0.9, 0.99]))
def test_histogram_quantile_lands_in_the_bucket_of_the_exact_quantile(
    values: list[float], q: float
) -> None:
    buckets = cumulative(values)
    estimate = compare.histogram_quantile(q, buckets)
    exact = sorted(values)[max(0, math.ceil(q * len(values)) - 1)]  # the rank PromQL targets
    assert compare.bucket_of(estimate, buckets) == compare.bucket_of(exact, buckets)


def test_proxy_figures_are_deltas_for_this_model_and_endpoint() -> None:
    labels = {"model": "m", "endpoint": CHAT}
    before = [
        ("tokenprobe_requests_total", {**labels, "error_type": "none"}, 5.0),
        ("tokenprobe_generation_tokens_total", {**labels, "source": "usage"}, 100.0),
    ]
    after = [
        ("tokenprobe_requests_total", {**labels, "error_type": "none"}, 8.0),
        ("tokenprobe_requests_total", {**labels, "error_type": "auth"}, 1.0),
        ("tokenprobe_requests_total", {"model": "x", "endpoint": CHAT, "error_type": "none"}, 9.0),
        ("tokenprobe_generation_tokens_total", {**labels, "source": "usage"}, 130.0),
        ("tokenprobe_time_to_first_token_seconds_bucket", {**labels, "le": "0.25"}, 4.0),
        ("tokenprobe_time_to_first_token_seconds_bucket", {**labels, "le": "+Inf"}, 4.0),
    ]
    figures = compare.proxy_figures(before, after, CHAT, "m")
    assert (figures.requests, figures.errors, figures.output_tokens) == (4, {"auth": 1}, 30)
    assert figures.ttft["p50"] == pytest.approx(0.125)


# -- report -----------------------------------------------------------------------------


def test_table_names_the_three_figures_apart() -> None:
    level = Level(0, 1, "c=1", start=0.0, end=1.0, results=[result()])
    text = report.table([summarize(level, {})])
    header = "\n".join(text.splitlines()[:2])
    for name in ("TTFT ms", "per-stream", "tok/s p50", "all streams", "out tok/s"):
        assert name in header
    assert "goodput" not in header


@pytest.mark.parametrize(
    ("error", "status", "message", "expected"),
    [
        (ErrorType.AUTH, 401, "Unauthorized", "auth: the backend rejected the API key"),
        (ErrorType.NOT_FOUND, 404, "The model `x` does not exist.", "not_found: unknown model 'm'"),
        (ErrorType.UPSTREAM_UNREACHABLE, 0, "ConnectionRefusedError: refused", "cannot connect to http://127.0.0.1:8000"),
        (ErrorType.CONTEXT_LENGTH, 400, "maximum context length is 64", "exceed the model's context length"),
        (ErrorType.RATE_LIMIT, 429, "slow down", "rate_limit: every request failed"),
    ],
)  # fmt: skip
def test_diagnosis_is_one_line_naming_the_problem(
    error: ErrorType, status: int, message: str, expected: str
) -> None:
    failed = result(error_type=error, status_code=status, error_message=message + "\nmore")
    line = report.diagnose(failed, options(), served=["sim-model"] if status == 404 else [])
    assert expected in line and "\n" not in line and message.split()[0] in line


def test_json_document_masks_the_key_and_keeps_every_record(tmp_path: Path) -> None:
    level = Level(0, 1, "c=1", start=5.0, end=6.0, results=[result(i) for i in range(3)])
    opts = options("--api-key", "sk-secret-123456", "--header", "Authorization: Bearer x")
    doc = report.document(opts, [level], [summarize(level, {})], status="complete", problem=None, compare=None)  # fmt: skip
    path = tmp_path / "out.json"
    report.write_json(str(path), doc)
    text = path.read_text()
    assert "sk-secret" not in text and "Bearer x" not in text
    loaded = orjson.loads(text)
    assert [r["index"] for r in loaded["records"]] == [0, 1, 2]
    assert loaded["records"][0]["ttft"] == 0.2 and loaded["records"][0]["scheduled"] == 5.0


def test_unwritable_output_fails_before_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    from proxy.bench.cli import main

    assert main([*BASE, "--out", "/nonexistent-dir/r.json"]) == 2
    assert "--out: cannot write to /nonexistent-dir" in capsys.readouterr().err


def test_table_warns_when_the_bench_itself_was_the_bottleneck() -> None:
    calm = Level(0, 1, "c=1", start=0.0, end=1.0, results=[result()], loop_lag=[0.0005] * 50)
    busy = Level(1, 64, "c=64", start=0.0, end=1.0, results=[result()], loop_lag=[0.02] * 50)
    text = report.table([summarize(calm, {}), summarize(busy, {})])
    assert "c=64: warning: the bench's own event loop ran 20.0 ms late" in text
    assert "c=1: warning" not in text


def test_the_table_says_when_output_tokens_are_content_events_counted() -> None:
    """Without usage and without --tokenizer the counts are content events, so tok/s and
    TPOT are per event: the table must say so, not only the JSON's token_sources."""
    from proxy.core.measurement import TokenSource

    chunks = [result(i, token_source=TokenSource.CHUNKS) for i in range(3)]
    mixed = Level(0, 1, "c=1", start=0.0, end=1.0, results=[*chunks, result(3)])
    usage = Level(1, 2, "c=2", start=0.0, end=1.0, results=[result(4), result(5)])
    text = report.table([summarize(mixed, {}), summarize(usage, {})])
    assert (
        "c=1: output tokens of 3 of 4 requests are content events counted (the backend sent "
        "no usage and no --tokenizer was given)"
    ) in text
    assert "c=2: output tokens" not in text


def test_late_sends_are_noted_for_every_open_loop_level_whatever_its_label() -> None:
    """An --input-tokens sweep labels its open-loop levels `in=16 rate=20/s`, and a replay
    `replay`: the note once looked for a label starting `rate=`, and said nothing there."""
    levels = [
        Level(0, 20, label, start=0.0, end=1.0, results=[result()])
        for label in ("in=16 rate=20/s", "replay")
    ]
    summaries = [summarize(level, {}) for level in levels]
    text = report.table(summaries, open_loop=True)
    assert "in=16 rate=20/s: sends were late by" in text and "replay: sends were late by" in text
    assert "sends were late" not in report.table(summaries)  # a closed loop's have no schedule


def test_the_bench_recounts_several_choices_each_alone_as_the_proxy_does(
    tmp_path: Path,
) -> None:
    """n = 2 without usage: each choice's output and reasoning counted alone and added up
    (vLLM's completion_tokens), not the two choices' interleaved texts joined."""
    from proxy.bench.client import finalize
    from proxy.core.observe import StreamObserver
    from proxy.core.tokens import count_output

    choices = (["Meas", "uring", " lat"], ["ency", " tok", "ens"])
    tokenizer = load_tokenizer(str(build_tiny_tokenizer(tmp_path)))
    api = api_for(CHAT)
    assert api is not None
    request = api.read_request({"model": "m", "stream": True, "n": 2, "messages": []})
    observer = StreamObserver(request, start=0.0, collect_text=True)
    observer.open(200, "text/event-stream", 0.0)
    for field in ("reasoning", "content"):
        for step in range(3):
            for index in (0, 1):
                delta = {field: choices[index][step]}
                chunk = {"choices": [{"index": index, "delta": delta, "finish_reason": None}]}
                observer.feed(b"data: " + orjson.dumps(chunk) + b"\n\n", 0.1 + step)
    for index in (0, 1):
        chunk = {"choices": [{"index": index, "delta": {}, "finish_reason": "length"}]}
        observer.feed(b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n", 4.0)
    m = observer.measurement(
        end=4.0,
        started_at=0.0,
        status_code=200,
        counts=observer.counts_from_chunks(),
        error_type=None,
        error_message=None,
    )
    result = Result(level=0, index=0, scheduled=0.0, sent=0.0, m=m, observer=observer)
    finalize(result, tokenizer)
    each = sum(count_output(tokenizer, texts) for texts in choices)
    joined = count_output(tokenizer, [text for step in zip(*choices, strict=True) for text in step])
    assert each != joined  # the check below tells the two apart
    assert result.m.output_tokens == 2 * each  # the reasoning is output too, as vLLM counts
    assert result.m.reasoning_tokens == each
