"""Every settings check runs in one place (proxy.settings.validate, from
Settings.__post_init__): a bad value is refused with the same SettingsError message
whether it comes from the command line (`tokenprobe serve`) or from `Settings(...)` in code."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from proxy.cli import main
from proxy.server.serve import build_app
from proxy.settings import Settings, SettingsError
from tests.paths import ROOT
from tests.server.conftest import no_proxy

pytestmark = no_proxy  # runs no proxy: once, on no data path

UPSTREAM = "http://127.0.0.1:9"
NOT_PRICES = str(
    ROOT / "tests" / "fixtures" / "errors" / "openai_rate_limit.json"
)  # JSON, no table

# (the flags after --upstream, the same value as a Settings field, words of the reason);
# the flag's text is the field's as `proxy.settings.text` writes it, so the messages match.
CASES: list[tuple[list[str], dict[str, Any], str]] = [
    (["--port", "70000"], {"port": 70000}, "between 0 and 65535"),
    (["--metrics-port", "-1"], {"metrics_port": -1}, "between 0 and 65535"),
    (["--connect-timeout", "0.0"], {"connect_timeout": 0.0}, "positive number of seconds"),
    (["--idle-timeout", "-5.0"], {"idle_timeout": -5.0}, "positive number of seconds"),
    (["--ws-idle-timeout", "nan"], {"ws_idle_timeout": float("nan")}, "positive number"),
    (["--models-refresh", "-1.0"], {"models_refresh": -1.0}, "positive number of seconds"),
    (["--header-timeout", "-2.0"], {"header_timeout": -2.0}, "positive number of seconds"),
    (["--max-body-bytes", "0"], {"max_body_bytes": 0}, "at least 1"),
    (["--max-headers", "-3"], {"max_headers": -3}, "at least 1"),
    (["--workers", "0"], {"workers": 0}, "at least 1"),
    (["--label-values", "0"], {"label_values": 0}, "at least 1"),
    (["--conversation-table", "0"], {"conversation_table": 0}, "at least 1"),
    (["--relay", "nginx"], {"relay": "nginx"}, "expected one of wire, asgi"),
    (
        ["--workers", "2", "--metrics-port", "9464"],
        {"workers": 2, "metrics_port": 9464},
        "--metrics-port takes one process",
    ),
    (["--uds", "/s/" + "x" * 105], {"uds": "/s/" + "x" * 105}, "at most 107 bytes"),
    # an empty token matched an empty `Authorization: Bearer` (review)
    (["--metrics-token", " "], {"metrics_token": " "}, "empty"),
    (
        ["--port", "18101", "--metrics-port", "18101"],
        {"port": 18101, "metrics_port": 18101},
        "is --port's too",
    ),
    (["--metrics-host", "0.0.0.0"], {"metrics_host": "0.0.0.0"}, "needs --metrics-port"),
    (["--upstream-uds", ""], {"upstream_uds": ""}, "the path of a Unix domain socket"),
    (["--access-log", "xml"], {"access_log": "xml"}, "expected one of json, text, off"),
    (["--key-label", "plain"], {"key_label": "plain"}, "expected one of none, hash"),
    (["--log-level", "INFO"], {"log_level": "INFO"}, "expected one of debug"),
    (["--upstream-transport", "curl"], {"upstream_transport": "curl"}, "expected one of"),
    (["--cost-per-hour", "-1.0"], {"cost_per_hour": -1.0}, "finite number >= 0"),
    (["--currency", " "], {"currency": " "}, "must not be empty"),
    # uvicorn binds an empty host to every interface: no one asks that by saying nothing
    (["--host", ""], {"host": ""}, "must not be empty"),
    # uvicorn's bind said only "[Errno -2] Name or service not known" (exit 3), naming no flag
    (["--host", "no-such-host.invalid"], {"host": "no-such-host.invalid"}, "cannot be resolved"),
    (
        ["--metrics-port", "18102", "--metrics-host", "no-such-host.invalid"],
        {"metrics_port": 18102, "metrics_host": "no-such-host.invalid"},
        "cannot be resolved",
    ),
    # a price table read at start, as --slo-file is: each worker failed to start and was
    # started again, and one worker stopped with a traceback
    (["--prices", "/no/such/prices.yaml"], {"prices": "/no/such/prices.yaml"}, "cannot read"),
    (["--prices", NOT_PRICES], {"prices": NOT_PRICES}, "unknown key 'error'"),
    # a directory that is not there: the proxy ran on and counted nothing
    (["--tokenizer", "/no/such/tok"], {"tokenizer": "/no/such/tok"}, "no such directory"),
    (["--continuation-cache-miss-ratio", "2.0"], {"continuation_cache_miss_ratio": 2.0}, "0 and 1"),
    (["--slo", "ttft=fast"], {"slo": "ttft=fast"}, "ttft"),
    (
        ["--conversation-header", "authorization"],
        {"conversation_header": "authorization"},
        "credentials",
    ),
    (["--label-header", "x-team"], {"label_header": ("x-team",)}, "expected HEADER=LABEL"),
    (["--label-header", "x-api-key=team"], {"label_header": ("x-api-key=team",)}, "credentials"),
    (["--label-header", "x-team=model"], {"label_header": ("x-team=model",)}, "is taken"),
    (
        ["--secret-headers", "x-team", "--label-header", "x-team=team"],
        {"secret_headers": ("x-team",), "label_header": ("x-team=team",)},
        "is a --secret-header",
    ),
]


def _cli_message(
    args: list[str], capsys: pytest.CaptureFixture[str], upstream: str = UPSTREAM
) -> str:
    assert main(["serve", "--upstream", upstream, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenprobe serve: ")
    return err.removeprefix("tokenprobe serve: ").strip()


@pytest.mark.parametrize(("args", "fields", "reason"), CASES, ids=lambda c: str(c)[:40])
def test_a_bad_value_is_refused_alike_in_code_and_on_the_command_line(
    args: list[str], fields: dict[str, Any], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    on_the_command_line = _cli_message(args, capsys)
    with pytest.raises(SettingsError) as in_code:
        Settings(upstream=UPSTREAM, **fields)
    assert str(in_code.value) == on_the_command_line
    assert reason in on_the_command_line


TLS = ROOT / "tests" / "fixtures" / "tls"
CERT, KEY = str(TLS / "test-only.crt"), str(TLS / "test-only.key")
SERVING = ["--ssl-certfile", CERT, "--ssl-keyfile", KEY]
HTTPS = "https://127.0.0.1:9"

# (the upstream, flags after it, the same as Settings fields, words of the reason)
TLS_CASES: list[tuple[str, list[str], dict[str, Any], str]] = [
    (UPSTREAM, ["--ssl-ca-certs", CERT], {"ssl_ca_certs": CERT}, "needs --ssl-certfile"),
    (UPSTREAM, ["--ssl-cert-reqs", "3"], {"ssl_cert_reqs": 3}, "expected 0 (no client"),
    (
        UPSTREAM,
        [*SERVING, "--ssl-cert-reqs", "2"],
        {"ssl_certfile": CERT, "ssl_keyfile": KEY, "ssl_cert_reqs": 2},
        "--ssl-cert-reqs 2 needs --ssl-ca-certs",
    ),
    (
        UPSTREAM,
        [*SERVING, "--ssl-ca-certs", KEY],
        {"ssl_certfile": CERT, "ssl_keyfile": KEY, "ssl_ca_certs": KEY},
        "not a CA bundle",
    ),
    (
        UPSTREAM,
        [*SERVING, "--ssl-ciphers", "NO-SUCH-CIPHER"],
        {"ssl_certfile": CERT, "ssl_keyfile": KEY, "ssl_ciphers": "NO-SUCH-CIPHER"},
        "OpenSSL knows none",
    ),
    (
        HTTPS,
        ["--upstream-ssl-certfile", CERT],
        {"upstream_ssl_certfile": CERT},
        "--upstream-ssl-certfile needs --upstream-ssl-keyfile",
    ),
    (
        HTTPS,
        ["--upstream-ca-certs", KEY],
        {"upstream_ca_certs": KEY},
        f"--upstream-ca-certs {KEY}: not a CA bundle",
    ),
    (
        HTTPS,
        ["--upstream-uds", "/run/vllm.sock", "--relay", "asgi"],
        {"upstream_uds": "/run/vllm.sock", "relay": "asgi"},
        "takes --upstream-transport httpx on --relay asgi",
    ),
    (
        UPSTREAM,
        ["--enable-ssl-refresh"],
        {"enable_ssl_refresh": True},
        "--enable-ssl-refresh needs --ssl-certfile",
    ),
    (
        UPSTREAM,
        ["--upstream-ca-certs", CERT],
        {"upstream_ca_certs": CERT},
        "--upstream-ca-certs needs an https:// --upstream",
    ),
]


@pytest.mark.parametrize(("upstream", "args", "fields", "reason"), TLS_CASES)
def test_tls_settings_that_cannot_work_are_refused_alike(
    upstream: str,
    args: list[str],
    fields: dict[str, Any],
    reason: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    on_the_command_line = _cli_message(args, capsys, upstream)
    with pytest.raises(SettingsError) as in_code:
        Settings(upstream=upstream, **fields)
    assert str(in_code.value) == on_the_command_line
    assert reason in on_the_command_line


def test_replace_runs_the_same_checks() -> None:
    with pytest.raises(SettingsError, match=r"^--port='70000': must be between 0 and 65535$"):
        Settings(upstream=UPSTREAM).replace(port=70000)


def test_a_bad_upstream_in_code_names_the_flag() -> None:
    with pytest.raises(SettingsError, match=r"^--upstream='vllm:8000': expected an http://"):
        Settings(upstream="vllm:8000")


def test_good_settings_in_code_pass_every_check() -> None:
    settings = Settings(upstream=UPSTREAM, label_header=("x-team=team",), slo="ttft=2")
    assert settings.label_header == ("x-team=team",)


class _HideTransformers:  # as if `pip install .` had not installed the tokenizer extra
    def find_spec(
        self, name: str, path: object = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if name == "transformers" or name.startswith("transformers."):
            raise ModuleNotFoundError("No module named 'transformers'")
        return None


@pytest.fixture
def without_transformers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in [m for m in sys.modules if m == "transformers" or m.startswith("transformers.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_HideTransformers(), *sys.meta_path])
    yield


@pytest.mark.usefixtures("without_transformers")
def test_a_tokenizer_without_transformers_is_refused_alike(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    on_the_command_line = _cli_message(["--tokenizer", str(tmp_path)], capsys)
    with pytest.raises(SettingsError) as in_code:
        build_app(Settings(upstream=UPSTREAM, tokenizer=str(tmp_path)))
    assert str(in_code.value) == on_the_command_line
    assert "pip install '.[tokenizer]' in tokenprobe's clone" in on_the_command_line


def test_settings_in_code_are_normalised_as_the_command_line_reads_them() -> None:
    """`Settings(...)` in code holds what the flags would: an upstream without its `/v1`
    (kept, /readyz probed /v1/v1/models and every request 404ed), a header timeout of 0
    off (kept, it was a 0-second timer), a token without its newline, a comma list split,
    a port number (review)."""
    settings = Settings(
        upstream="HTTP://127.0.0.1:9/v1/",
        header_timeout=0,
        metrics_token="tok\n",
        model_allowlist="m1,m2",  # type: ignore[arg-type]
        port="4001",  # type: ignore[arg-type]
    )
    assert settings.upstream == "http://127.0.0.1:9"
    assert (settings.header_timeout, settings.metrics_token) == (None, "tok")
    assert (settings.model_allowlist, settings.port) == (("m1", "m2"), 4001)
    assert settings == Settings(
        upstream="http://127.0.0.1:9", header_timeout=None, metrics_token="tok",
        model_allowlist=("m1", "m2"), port=4001,
    )  # fmt: skip
