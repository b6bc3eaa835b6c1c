"""Which names carry credentials, and what `redact` masks in an upstream's error text
(proxy/core/secrets.py): everything a client sent as a credential, and nothing else."""

from __future__ import annotations

import pytest

from proxy.core.secrets import SECRET_HEADERS, is_secret_header, redact


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("authorization", True),
        ("x-goog-api-key", True),
        ("ocp-apim-subscription-key", True),  # Azure API Management
        ("x-functions-key", True),  # Azure Functions
        ("x-auth-token", True),
        # names that end in "key" and carry none: labels an operator may choose
        ("x-tenant-key", False),
        ("idempotency-key", False),
        ("x-routing-key", False),
        ("x-team", False),
    ],
)
def test_a_header_is_secret_by_its_name(name: str, secret: bool) -> None:
    assert is_secret_header(name) is secret


def masked(message: str, headers: list[tuple[bytes, bytes]], query: str = "") -> str:
    return redact(message, headers, SECRET_HEADERS, query)


def test_a_session_cookie_is_masked_alone_and_a_settings_cookie_is_not() -> None:
    sent = [(b"cookie", b"theme=dark; consent=true; session=3f9a0c1d2e4b5a6978")]
    said = "model 'dark-llama' failed: expected true, session 3f9a0c1d2e4b5a6978 unknown"
    assert masked(said, sent) == (
        "model 'dark-llama' failed: expected true, session [redacted] unknown"
    )


def test_a_key_offered_as_a_websocket_subprotocol_is_masked() -> None:
    sent = [(b"sec-websocket-protocol", b"realtime, openai-insecure-api-key.PROTOKEY12345")]
    assert masked("bad key PROTOKEY12345", sent) == "bad key [redacted]"
    assert masked("protocol realtime refused", sent) == "protocol realtime refused"


def test_azure_key_headers_and_parameters_are_masked() -> None:
    sent = [(b"ocp-apim-subscription-key", b"APIMKEY7777"), (b"x-functions-key", b"FUNCKEY8888")]
    said = "denied APIMKEY7777 FUNCKEY8888 SUBKEY9999 CODE0000"
    query = "subscription-key=SUBKEY9999&code=CODE0000"
    assert masked(said, sent, query) == "denied [redacted] [redacted] [redacted] [redacted]"
