"""The upstream's address, parsed once (proxy/core/upstream_url.py)."""

from __future__ import annotations

import pytest

from proxy.core.upstream_url import UpstreamURL


def test_host_port_authority_and_no_base_path() -> None:
    up = UpstreamURL.parse("http://127.0.0.1:8000")
    assert (up.scheme, up.host, up.port, up.authority, up.base_path) == (
        "http",
        "127.0.0.1",
        8000,
        b"127.0.0.1:8000",
        "",
    )
    assert up.origin == "http://127.0.0.1:8000"
    assert up.target("/v1/models") == "/v1/models"


@pytest.mark.parametrize(
    ("url", "authority", "port", "tls"),
    [
        ("http://vllm", b"vllm", 80, False),
        ("https://api.example.com", b"api.example.com", 443, True),
        ("https://api.example.com:8443", b"api.example.com:8443", 8443, True),
        ("http://[::1]:9000", b"[::1]:9000", 9000, False),
        ("http://vllm:80/x", b"vllm", 80, False),  # the default port is not written
    ],
)
def test_the_default_port_is_left_out_of_the_authority(
    url: str, authority: bytes, port: int, tls: bool
) -> None:
    up = UpstreamURL.parse(url)
    assert (up.authority, up.port, up.tls) == (authority, port, tls)


@pytest.mark.parametrize(
    "base", ["http://h:1/tenant-a", "http://h:1/tenant-a/", "http://h:1/tenant-a//"]
)
def test_the_base_path_goes_before_every_target_with_one_slash(base: str) -> None:
    up = UpstreamURL.parse(base)
    assert up.base_path == "/tenant-a"
    assert up.target("/v1/x") == "/tenant-a/v1/x"  # never //v1/x
    assert up.target("/v1/x", "a=1&b=%20") == "/tenant-a/v1/x?a=1&b=%20"
    assert up.target("/") == "/tenant-a/"


def test_a_bare_slash_is_no_base_path() -> None:
    assert UpstreamURL.parse("http://h:1/").target("/v1/x", "q") == "/v1/x?q"


def test_a_non_ascii_base_path_is_percent_encoded() -> None:
    assert UpstreamURL.parse("http://h:1/t\u00e9nant").base_path == "/t%C3%A9nant"


@pytest.mark.parametrize("url", ["ftp://h/x", "http://", "h:80", "http://h\u00e9:1"])
def test_what_is_not_an_http_upstream_is_refused(url: str) -> None:
    with pytest.raises(ValueError):
        UpstreamURL.parse(url)
