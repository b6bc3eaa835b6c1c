"""Settings: a flag wins over its TOKENPROBE_* variable, which wins over the default; a bad
value fails at start naming the flag or variable it came from."""

from __future__ import annotations

import dataclasses

import pytest

from proxy.settings import REQUIRED, SPECS, Settings, SettingsError, parse, resolve
from tests.server.conftest import no_proxy

pytestmark = no_proxy  # runs no proxy: once, on no data path

UPSTREAM = ["--upstream", "http://vllm:8000"]


def test_defaults_when_only_the_upstream_is_given() -> None:
    assert parse(UPSTREAM, {}) == Settings(upstream="http://vllm:8000")


def test_every_field_is_one_spec_with_its_flag_variable_and_default() -> None:
    defaults = Settings(upstream="http://vllm:8000")
    assert [spec.name for spec in SPECS] == [f.name for f in dataclasses.fields(Settings)]
    for spec in SPECS[1:]:
        assert getattr(defaults, spec.name) == spec.default, spec.name
        assert spec.flag == "--" + spec.name.replace("_", "-")
        assert spec.env == "TOKENPROBE_" + spec.name.upper()
    assert SPECS[0].default is REQUIRED and SPECS[0].shown == "(required)"


def test_env_var_overrides_default() -> None:
    assert parse(UPSTREAM, {"TOKENPROBE_PORT": "5000"}).port == 5000


def test_flag_overrides_env_var() -> None:
    assert parse([*UPSTREAM, "--port", "6000"], {"TOKENPROBE_PORT": "5000"}).port == 6000


def test_negated_switch_overrides_env_var() -> None:
    settings = parse([*UPSTREAM, "--no-inject-usage"], {"TOKENPROBE_INJECT_USAGE": "true"})
    assert settings.inject_usage is False


def test_switch_is_read_from_env_var() -> None:
    assert parse(UPSTREAM, {"TOKENPROBE_TRACE_CONTENT": "yes"}).trace_content is True


def test_resolve_accepts_a_plain_mapping_of_flags() -> None:
    flags = {"port": "7000", "upstream": "http://vllm:8000"}
    assert resolve(flags, {"TOKENPROBE_PORT": "5000"}).port == 7000


def test_unrelated_env_vars_are_ignored() -> None:
    env = {"PORT": "1", "TOKENPROBE": "x", "TOKENPROBE_UPSTREAM": "http://vllm:8000"}
    assert parse([], env) == Settings(upstream="http://vllm:8000")


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("http://vllm:8000", "http://vllm:8000"),
        ("http://vllm:8000/", "http://vllm:8000"),
        ("https://vllm.example/v1", "https://vllm.example"),
        ("http://vllm:8000/v1/", "http://vllm:8000"),
        ("http://gw/tenant-a", "http://gw/tenant-a"),
        ("HTTPS://vllm.example:8443/v1", "https://vllm.example:8443"),  # TLS everywhere
    ],
)
def test_upstream_is_normalised_without_v1(raw: str, want: str) -> None:
    assert parse(["--upstream", raw], {}).upstream == want


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("http://user:secret@vllm:8000", "no credentials in the URL"),
        ("http://vllm:8000?tenant=a", "takes no query"),
        ("http://vllm:8000/v1#frag", "or fragment"),
    ],
)
def test_an_upstream_with_credentials_a_query_or_a_fragment_is_refused(
    raw: str, reason: str
) -> None:
    """Credentials were shown on /readyz and in the log, and sent by the control calls
    alone; a query or fragment was glued to every control-plane URL (`/?tenant=a/v1/models`)
    and kept `/v1` on the data path (`/v1/v1/chat/completions`)."""
    with pytest.raises(SettingsError) as refused:
        parse(["--upstream", raw], {})
    assert reason in str(refused.value) and "secret" not in str(refused.value)
    with pytest.raises(SettingsError):
        Settings(upstream=raw)


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("http://admin:p@ssLEAK1@vllm:8000", "no credentials in the URL"),
        # urllib ends the authority at the first `# / ?`, so the password's end read as a
        # port: its own words quoted it ("... as 'p'"), and the URL went out whole
        ("http://admin:p#LEAK2@vllm:8000", "bad port"),
        ("http://admin:LEAK3/x@vllm:8000", "bad port"),
        ("http://admin:LEAK4?x@vllm:8000", "bad port"),
        ("admin:LEAK7@vllm:8000", "http:// or https://"),  # no scheme
    ],
)
def test_a_refused_upstream_never_shows_its_password(raw: str, reason: str) -> None:
    """The refusal is printed at start and lands in logs (journald, a pod's events)."""
    for given in (lambda: parse(["--upstream", raw], {}), lambda: parse([], {"TOKENPROBE_UPSTREAM": raw})):  # fmt: skip
        with pytest.raises(SettingsError) as refused:
            given()
        said = str(refused.value)
        assert reason in said and "LEAK" not in said, said
        assert "'***@vllm:" in said or "//***@vllm:" in said, said


def test_an_uppercase_https_upstream_is_tls_for_every_client() -> None:
    """`HTTPS://` built in code: the tunnel once took it for plain http (the wire's pool
    did not), and --upstream-ca-certs was refused for it."""
    from proxy.server.dial import upstream_tls

    assert upstream_tls(Settings(upstream="HTTPS://vllm.example")) is not None
    assert upstream_tls(Settings(upstream="http://vllm.example")) is None


@pytest.mark.parametrize(
    ("raw", "want"), [("a, b,,c ", ("a", "b", "c")), ("", ()), ("solo", ("solo",))]
)
def test_comma_lists_are_split_and_trimmed(raw: str, want: tuple[str, ...]) -> None:
    assert parse([*UPSTREAM, "--model-allowlist", raw], {}).model_allowlist == want


@pytest.mark.parametrize("raw", ["0", "off", "none", ""])
def test_models_refresh_can_be_disabled(raw: str) -> None:
    assert parse(UPSTREAM, {"TOKENPROBE_MODELS_REFRESH": raw}).models_refresh is None


# -- every validator names what was wrong -----------------------------------------------------

BAD_VALUES = [
    ("upstream", "vllm:8000", "http:// or https://"),
    ("upstream", "ftp://vllm", "http:// or https://"),
    ("upstream", "http://vllm:99999", "bad port"),
    ("port", "70000", "between 0 and 65535"),
    ("port", "http", "invalid literal"),
    ("connect_timeout", "0", "positive number of seconds"),
    ("idle_timeout", "-5", "positive number of seconds"),
    ("first_byte_timeout", "nan", "positive number of seconds"),
    ("models_refresh", "-1", "positive number of seconds"),
    ("max_body_bytes", "0", "at least 1"),
    ("workers", "two", "invalid literal"),
    ("upstream_transport", "curl", "expected one of aiohttp, httpx"),
    ("access_log", "xml", "expected one of json, text, off"),
    ("key_label", "plain", "expected one of none, hash"),
    ("log_level", "INFO", "expected one of debug"),
    ("metrics_port", "-1", "between 0 and 65535"),
]


@pytest.mark.parametrize(("name", "raw", "reason"), BAD_VALUES)
def test_bad_flag_value_error_names_the_flag(name: str, raw: str, reason: str) -> None:
    flag = "--" + name.replace("_", "-")
    with pytest.raises(SettingsError) as info:
        parse([*UPSTREAM, flag, raw] if name != "upstream" else [flag, raw], {})
    assert str(info.value).startswith(f"{flag}={raw!r}: ")
    assert reason in str(info.value)


@pytest.mark.parametrize(("name", "raw", "reason"), BAD_VALUES)
def test_bad_env_value_error_names_the_variable(name: str, raw: str, reason: str) -> None:
    env = "TOKENPROBE_" + name.upper()
    with pytest.raises(SettingsError) as info:
        parse([], {env: raw})
    assert str(info.value).startswith(f"{env}={raw!r}: ")
    assert reason in str(info.value)


def test_bad_switch_env_value_names_the_variable() -> None:
    with pytest.raises(SettingsError, match=r"^TOKENPROBE_INJECT_USAGE='maybe': expected true"):
        parse([], {"TOKENPROBE_INJECT_USAGE": "maybe"})


def test_a_good_flag_hides_a_bad_env_var() -> None:
    assert parse([*UPSTREAM, "--port", "4001"], {"TOKENPROBE_PORT": "bad"}).port == 4001


def test_settings_error_is_a_value_error() -> None:
    assert issubclass(SettingsError, ValueError)


# -- the upstream is required to serve --------------------------------------------------------


def test_the_upstream_is_taken_from_its_variable() -> None:
    assert parse([], {"TOKENPROBE_UPSTREAM": "http://vllm:8000/v1"}).upstream == "http://vllm:8000"


def test_no_upstream_fails_naming_flag_and_variable() -> None:
    with pytest.raises(SettingsError) as info:
        parse([], {})
    message = str(info.value)
    assert "--upstream" in message
    assert "TOKENPROBE_UPSTREAM" in message
