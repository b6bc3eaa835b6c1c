"""OTEL_EXPORTER_OTLP_*HEADERS that the OpenTelemetry SDK cannot read are refused at start
(proxy/sinks/otel_env.py), by the variable and the entry's number, never its text.

The SDK logged such an entry whole, `Authorization: Bearer <token>` and all, at the
default level, before tokenprobe's logging was set up, twice (tokenprobe's parse and the
exporter's own), dropped it, and sent spans without their auth."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from proxy.server.assemble import check_environment
from proxy.settings import SettingsError
from proxy.sinks.otel_env import otlp_target

#: The mistakes operators make, each with a token in it.
MALFORMED = [
    "Authorization: Bearer LEAKTOKEN1",  # `:` for `=`, as in an HTTP header
    'x-api-key="LEAKTOKEN2"',  # quoted
    "authorization=Bearer LEAKTOKEN3;tenant=a",  # `;` between entries
    "x-api-key=LEAK\\TOKEN4",  # a backslash
]


@pytest.mark.parametrize("entry", MALFORMED)
@pytest.mark.parametrize(
    ("variable", "signal"),
    [
        ("OTEL_EXPORTER_OTLP_HEADERS", "traces"),
        ("OTEL_EXPORTER_OTLP_HEADERS", "metrics"),
        ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "traces"),
        ("OTEL_EXPORTER_OTLP_METRICS_HEADERS", "metrics"),
    ],
)
def test_an_entry_the_sdk_cannot_read_is_refused_by_its_number_and_nothing_is_logged(
    entry: str, variable: str, signal: str, caplog: pytest.LogCaptureFixture
) -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", variable: f"x-team=TEAMVALUE9, {entry}"}
    with caplog.at_level(logging.DEBUG), pytest.raises(SettingsError) as refused:
        otlp_target(env, signal)  # type: ignore[arg-type]
    said = str(refused.value)
    assert said.startswith(f"{variable}: entry 2 of 2 is not NAME=VALUE"), said
    assert "LEAK" not in said and "TEAMVALUE" not in said, said
    assert not [r.getMessage() for r in caplog.records if "LEAK" in r.getMessage()]


@pytest.mark.parametrize("exporter", ["OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER"])
def test_the_parent_of_workers_refuses_it_before_any_worker_starts(exporter: str) -> None:
    environ = {
        exporter: "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
        "OTEL_EXPORTER_OTLP_HEADERS": MALFORMED[0],
    }
    with pytest.raises(SettingsError, match="OTEL_EXPORTER_OTLP_HEADERS: entry 1 of 1") as refused:
        check_environment(environ)
    assert "LEAK" not in str(refused.value)


def test_readable_entries_are_sent_as_the_sdk_reads_them() -> None:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
        "OTEL_EXPORTER_OTLP_HEADERS": "Authorization=Bearer%20T1 , x-scope-orgid = a b,,",
    }
    assert otlp_target(env, "traces").headers == {"authorization": "Bearer T1", "x-scope-orgid": "a b"}  # fmt: skip


@pytest.mark.parametrize(
    "entry",
    [
        *MALFORMED,
        *("a=b", " a = b ", "a=", "a=b=c", "a=b c", "a=%22q%22", "a.b_c-d=1:2/3", "A=é"),
        *("=b", "a", "a b=c", "a:b=c", "a=b\tc", "a=b\x7f", "(a)=b", "a=b,c=d"),
    ],
)
def test_what_is_refused_is_what_the_sdk_would_log_and_drop(
    entry: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The check is the SDK's reading (opentelemetry/util/re.py, `parse_env_headers` with
    `liberal=True`, as the exporters call it), written again: held to it here, entry by
    entry, so an SDK that reads otherwise fails this test rather than logging a token."""
    from opentelemetry.util.re import parse_env_headers

    from proxy.sinks.otel_env import _check_headers

    with caplog.at_level(logging.WARNING, logger="opentelemetry.util.re"):
        parse_env_headers(entry, liberal=True)
    sdk_refuses = any(r.name == "opentelemetry.util.re" for r in caplog.records)
    try:
        _check_headers("OTEL_EXPORTER_OTLP_HEADERS", entry)
        refused = False
    except SettingsError:
        refused = True
    assert refused is sdk_refuses


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_refuses_to_start_in_one_line_that_holds_no_token(workers: str) -> None:
    env = {
        **os.environ,
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
        "OTEL_EXPORTER_OTLP_HEADERS": MALFORMED[0],
    }
    out = subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--upstream", "http://127.0.0.1:9",
         "--port", "0", "--workers", workers],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("tokenprobe serve: OTEL_EXPORTER_OTLP_HEADERS: entry 1 of 1")
    assert "LEAK" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
