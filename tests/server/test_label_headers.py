"""--label-header: a request header's value as a bounded label, end to end through a real
`tokenprobe serve` process: Prometheus series, OTLP metrics, spans and the access log."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from proxy.core.labels import MAX_LABEL_CHARS, HeaderLabels, sanitise
from proxy.settings import SettingsError, parse
from proxy.sinks.metrics import first_counted
from tests.conftest import MODEL, Running
from tests.otlp_receiver import OtlpReceiver, points
from tests.scrape import scrape
from tests.server.conftest import no_proxy
from tests.servers import free_port, serve, spawn, stop, wait_http

N = 10  # --label-values
UP = ["--upstream", "http://127.0.0.1:9"]


def series(base: str, name: str) -> list[dict[str, str]]:
    return [s.labels for s in scrape(base).series(name)]


def test_300_team_values_stay_bounded_everywhere(
    start_sim: Callable[..., Running], tmp_path: Path
) -> None:
    sim = start_sim(ttft=0.0, tokens_per_second=5000.0, output_tokens=2)
    rng = random.Random(19)
    teams = [f"team-{rng.randrange(10**9)}" for _ in range(300)]
    first = list(dict.fromkeys(teams))[:N]
    receiver = OtlpReceiver()
    port = free_port()
    log_path = tmp_path / "access.log"
    with serve(receiver) as collector, log_path.open("wb") as log_file:
        process = spawn(
            "serve",
            "--upstream",
            sim.url,
            "--port",
            str(port),
            "--model-allowlist",
            MODEL,
            "--models-refresh",
            "0",
            "--label-header",
            "x-team=team",
            "--label-values",
            str(N),
            env={
                "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,  # traces and metrics
                "OTEL_METRICS_EXPORTER": "otlp",
                "OTEL_METRIC_EXPORT_INTERVAL": "100",
                "OTEL_BSP_SCHEDULE_DELAY": "50",
            },
            stdout=log_file.fileno(),  # the access log
        )
        base = f"http://127.0.0.1:{port}"
        try:
            wait_http(base + "/healthz")
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            with httpx.Client(base_url=base, timeout=30) as client:
                for team in teams:
                    response = client.post(
                        "/v1/chat/completions", json=body, headers={"x-team": team}
                    )
                    assert response.status_code == 200
                # One without the header: "none".
                assert client.post("/v1/chat/completions", json=body).status_code == 200
            requests = series(base, "tokenprobe_requests_total")
            latency = series(base, "tokenprobe_e2e_request_latency_seconds_count")

            def all_counted(exports: list[Any]) -> bool:
                found = points(exports[-1]) if exports else []
                done = sum(p.count for p in found if p.metric == "gen_ai.client.inference.duration")
                return done >= 301

            exports = receiver.metrics.wait_for(all_counted)
            spans = receiver.wait_for(lambda s: len(s) >= 301, timeout=30)
        finally:
            stop(process)
    log = [orjson.loads(line) for line in log_path.read_bytes().splitlines()]

    expected = {*first, "other", "none"}
    assert {s["team"] for s in requests} == expected
    assert {s["team"] for s in latency} == expected
    # the outcomes each pair starts with at 0 (proxy/sinks/metrics.py first_counted), the
    # one counted (200, stop) among them
    assert len(requests) == len(expected) * len(first_counted("/v1/chat/completions"))
    found = points(exports[-1])
    duration = [p for p in found if p.metric == "gen_ai.client.inference.duration"]
    assert {p.attributes["team"] for p in duration} == expected
    by_team = {p.attributes["team"]: p.count for p in duration}
    assert by_team["other"] == sum(1 for t in teams if t not in first)
    assert all(by_team[t] == teams.count(t) for t in first)
    assert {s.attributes["team"] for s in spans} == expected
    assert [line["labels"]["team"] for line in log] == [
        t if t in first else "other" for t in teams
    ] + ["none"]


@no_proxy
@pytest.mark.parametrize(
    "header", ["authorization", "Authorization", "x-api-key", "cookie", "proxy-authorization"]
)
def test_a_secret_header_as_label_is_refused_at_start_up(header: str) -> None:
    process = spawn("serve", "--upstream", "http://127.0.0.1:9", "--label-header", f"{header}=team")
    try:
        _, err = process.communicate(timeout=30)
    finally:
        stop(process)
    assert process.returncode == 2
    assert b"--label-header" in err and b"secret header never becomes a label" in err


@no_proxy
def test_a_secret_header_named_by_secret_header_is_refused_too() -> None:
    with pytest.raises(SettingsError, match="is a --secret-header"):
        parse([*UP, "--label-header", "x-tenant=tenant", "--secret-headers", "X-Tenant"], {})


@no_proxy
def test_label_header_flags_repeat_and_combine_with_the_variable() -> None:
    settings = parse([*UP, "--label-header", "X-Team=team", "--label-header", "x-app=app"], {})
    assert settings.label_header == ("x-team=team", "x-app=app")
    env = parse(UP, {"TOKENPROBE_LABEL_HEADER": "x-team=team,x-app=app"})
    assert env.label_header == settings.label_header


@no_proxy
@pytest.mark.parametrize(
    "value",
    ["x-team", "x-team=", "=team", "x-team=te-am", "x-team=model", "x team=team", "a=t,b=t"],
)
def test_bad_label_headers_are_refused(value: str) -> None:
    with pytest.raises(SettingsError, match="--label-header"):
        parse([*UP, "--label-header", value], {})


@no_proxy
def test_values_are_sanitised_cut_short_and_bounded() -> None:
    labels = HeaderLabels(("x-team",), max_values=2)
    assert labels([(b"x-team", b' a "b"\n{c} ')]) == ("a__b___c_",)
    assert labels([(b"x-team", b"x" * 10_000)]) == ("x" * MAX_LABEL_CHARS,)
    assert labels([(b"x-team", b"third")]) == ("other",)
    assert labels([(b"x-team", b' a "b"\n{c} ')]) == ("a__b___c_",)  # admitted before
    assert labels([]) == ("none",) and labels([(b"x-team", b"  ")]) == ("none",)
    assert sanitise("é".encode()) == "__"  # latin-1 decoded, then not plain


@no_proxy
def test_the_access_log_carries_the_labels_in_json_and_logfmt() -> None:
    import io

    from proxy.sinks.logs import AccessLog
    from proxy.sinks.sink import Labels
    from tests.factories import measurement

    def line(mode: str) -> str:
        out = io.StringIO()
        log = AccessLog(mode, out, ("team", "app"))
        log.record(measurement(), Labels(MODEL, None, ("red", "none")))
        return out.getvalue()

    assert orjson.loads(line("json"))["labels"] == {"team": "red", "app": "none"}
    assert " labels.team=red labels.app=none" in line("text")


def test_a_refused_request_is_counted_with_none_labels_and_no_sink_fails(
    sim: Running, start_proxy: Callable[..., Any]
) -> None:
    proxy = start_proxy(sim.url, label_header=("x-team=team",), max_body_bytes=64)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 200}]}
    response = httpx.post(proxy.url + "/v1/chat/completions", json=body, headers={"x-team": "red"})
    assert response.status_code == 413
    proxy.wait_records(1)
    # Refused before its body was read: no model either.
    labels = {"model": "other", "endpoint": "/v1/chat/completions", "team": "none"}
    outcome = {"code": "413", "finish_reason": "none", "error_type": "bad_request"}
    assert proxy.sample("tokenprobe_requests_total", **labels, **outcome) == 1
    failures = proxy.registry.get_sample_value(
        "tokenprobe_measurement_failures_total", {"stage": "sink"}
    )
    assert not failures


def test_a_credential_shaped_value_is_other_everywhere(
    start_sim: Callable[..., Running], tmp_path: Path
) -> None:
    """A key sent in the label's header (by mistake, or by a client that sends its key in
    every header) is exported nowhere: /metrics, OTLP metrics, spans and the access log
    all say `other`, and the value takes none of the --label-values places."""
    sim = start_sim(ttft=0.0, tokens_per_second=5000.0, output_tokens=2)
    keys = [
        "sk-CANARYLABELKEY77abcdef",
        "Bearer sk-CANARYLABELKEY78abcdef",
        "Bearer CANARYOPAQUE79",
        "Basic Q0FOQVJZQkFTSUM4MDpwYXNz",  # base64 of CANARYBASIC80:pass
        "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJDQU5BUlk4MSJ9.CANARYJWT81",
    ]
    receiver = OtlpReceiver()
    port = free_port()
    log_path = tmp_path / "access.log"
    with serve(receiver) as collector, log_path.open("wb") as log_file:
        process = spawn(
            "serve", "--upstream", sim.url, "--port", str(port), "--model-allowlist", MODEL,
            "--models-refresh", "0", "--label-header", "x-team=team", "--label-values", "1",
            env={
                "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,  # traces and metrics
                "OTEL_METRICS_EXPORTER": "otlp",
                "OTEL_METRIC_EXPORT_INTERVAL": "100",
                "OTEL_BSP_SCHEDULE_DELAY": "50",
            },
            stdout=log_file.fileno(),  # the access log
        )  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        try:
            wait_http(base + "/healthz")
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            with httpx.Client(base_url=base, timeout=30) as client:
                for team in [*keys, "red"]:  # the one place is still free for "red"
                    response = client.post(
                        "/v1/chat/completions", json=body, headers={"x-team": team}
                    )
                    assert response.status_code == 200
            metrics = httpx.get(base + "/metrics", timeout=30).text
            requests = series(base, "tokenprobe_requests_total")

            def all_counted(exports: list[Any]) -> bool:
                found = points(exports[-1]) if exports else []
                done = sum(p.count for p in found if p.metric == "gen_ai.client.inference.duration")
                return done >= len(keys) + 1

            exports = receiver.metrics.wait_for(all_counted)
            spans = receiver.wait_for(lambda s: len(s) >= len(keys) + 1, timeout=30)
        finally:
            stop(process)
    log = log_path.read_text()

    assert {s["team"] for s in requests} == {"other", "red"}
    duration = [p for p in points(exports[-1]) if p.metric == "gen_ai.client.inference.duration"]
    assert {p.attributes["team"]: p.count for p in duration} == {"other": len(keys), "red": 1}
    assert [s.attributes["team"] for s in spans] == ["other"] * len(keys) + ["red"]
    assert [orjson.loads(line)["labels"]["team"] for line in log.splitlines()] == ["other"] * len(
        keys
    ) + ["red"]
    exported = (metrics, log, repr(spans), repr(exports))
    assert not [part for part in exported if "CANARY" in part or "Q0FOQVJZ" in part]
