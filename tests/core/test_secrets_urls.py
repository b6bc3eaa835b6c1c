"""A URL fit to show (proxy/core/secrets.py `masked_url`): what the settings' refusals, the
bench's run file and stderr, and the access line under uvicorn write of a URL. Its user
info goes whole, however the password is spelled; credential parameters lose their
values; everything else an operator reads stays."""

from __future__ import annotations

import pytest

from proxy.core.secrets import mask_values, masked_query, masked_url, url_credentials


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        # a password holding `@ # / ?`: each ends the authority for urllib, which read the
        # rest as the host or port (and a regex that stopped there showed it)
        ("http://admin:p@ssLEAK1@vllm:8000", "http://***@vllm:8000"),
        ("http://admin:pa#LEAK2@vllm:8000/v1", "http://***@vllm:8000/v1"),
        ("http://admin:LEAK3/x@vllm:8000", "http://***@vllm:8000"),
        ("http://admin:LEAK4?x@vllm:8000", "http://***@vllm:8000"),
        # a name alone can be the token (`https://TOKEN@host`)
        ("https://LEAK5TOKEN@gw.example/metrics", "https://***@gw.example/metrics"),
        # malformed: refused for its scheme, shown all the same
        ("htp://user:LEAK6@vllm/v1", "htp://***@vllm/v1"),
        ("user:LEAK7@vllm:8000", "***@vllm:8000"),  # no scheme
    ],
)
def test_the_user_info_is_masked_whole_whatever_the_password_holds(url: str, shown: str) -> None:
    assert masked_url(url) == shown
    assert "LEAK" not in masked_url(url)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (
            "http://c:4318/v1/traces?api-key=LEAK1&tenant=a",
            "http://c:4318/v1/traces?api-key=***&tenant=a",
        ),
        ("http://h/metrics?token=LEAK2", "http://h/metrics?token=***"),
        (
            "http://h/x?API%5FKEY=LEAK3&key=LEAK4&sig=LEAK5",
            "http://h/x?API%5FKEY=***&key=***&sig=***",
        ),
        # OAuth's implicit grant puts the token in the fragment
        ("http://h/cb#access_token=LEAK6&state=s", "http://h/cb#access_token=***&state=s"),
        ("http://u:LEAK7@h/m?token=LEAK8#x", "http://***@h/m?token=***#x"),
    ],
)
def test_credential_parameters_lose_their_values_and_others_stay(url: str, shown: str) -> None:
    assert masked_url(url) == shown


@pytest.mark.parametrize(
    "url",
    ["http://vllm:8000", "https://vllm.example:8443/v1?model=m&n=2#frag", "", "?", "not a url"],
)
def test_a_url_without_credentials_is_shown_as_it_is(url: str) -> None:
    assert masked_url(url) == url


def test_an_at_sign_past_the_host_masks_too_much_which_only_hides_more() -> None:
    """Where the user info ends cannot be told from `//a@b/c@d` (a password with `/`, or a
    path with `@`): the last `@` is taken, so nothing of a password is ever shown."""
    assert masked_url("http://h/p?email=a@b") == "http://***@b"


def test_a_query_keeps_its_order_and_every_other_parameter() -> None:
    assert masked_query("model=m&api_key=K1&x&code=&Session=S") == (
        "model=m&api_key=***&x&code=***&Session=***"
    )


def test_a_urls_credentials_are_masked_in_a_librarys_own_words() -> None:
    """What urllib3 and requests write of the URL they were given: its path and query, or
    all of it, in their sentences; each credential is masked wherever it is."""
    url = "http://collector%40corp:pa%2Fss@127.0.0.1:4318/v1/traces?api-key=QKEY1234&x=1"
    values = url_credentials(url)
    said = (
        "Max retries exceeded with url: /v1/traces?api-key=QKEY1234&x=1; "
        "No connection adapters were found for 'http://collector%40corp:pa%2Fss@127.0.0.1:4318'; "
        "auth collector@corp pa/ss"
    )
    masked = mask_values(said, values)
    for secret in ("QKEY1234", "collector%40corp", "pa%2Fss", "collector@corp", "pa/ss"):
        assert secret not in masked, masked
    assert "/v1/traces?api-key=[redacted]&x=1" in masked
