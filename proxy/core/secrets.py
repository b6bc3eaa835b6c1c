"""Credentials: which header and parameter names carry them, and masking them in the error
text an upstream echoes (the only text of a request's that the proxy logs, traces and
records), and in a URL shown to an operator (a refusal of a setting, the bench's run file,
a library's log line). Shared by the relays, the tunnel, the settings, the sinks and the
bench: every path that reports a credential's carrier masks the same things."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from urllib.parse import unquote, unquote_plus

#: Request headers whose values never appear in logs, traces, metrics or error messages
#: (the relay also drops them from anything it reports; --secret-header adds more).
SECRET_HEADERS = frozenset(
    {b"authorization", b"proxy-authorization", b"api-key", b"x-api-key", b"cookie", b"set-cookie"}
)
#: Words that make any header or query parameter name one that carries credentials
#: (`x-goog-api-key`, `x-auth-token`, `?access_token=`): never a label, always redacted.
SECRET_WORDS = (
    *("auth", "api-key", "api_key", "apikey", "token", "secret", "password", "passwd"),
    *("credential", "cookie", "session"),
    # signed URLs' `?X-Amz-Signature=` (AWS SigV4), `?X-Goog-Signature=` (Google Cloud)
    "signature",
    # Azure API Management's `ocp-apim-subscription-key` and `?subscription-key=`, Azure
    # Functions' `x-functions-key` (not any name ending in "key": `idempotency-key`)
    *("subscription-key", "functions-key"),
)
#: Query parameter names that carry credentials by themselves (Google's `?key=`, signed
#: URLs' `?sig=`, Azure Functions' `?code=`), besides those with a SECRET_WORDS word in them.
SECRET_PARAMS = frozenset({"key", "sig", "code"})


def is_secret_name(name: str) -> bool:
    """A (lower-case) header or query parameter name that carries credentials by its words."""
    return any(word in name for word in SECRET_WORDS)


def is_secret_param(name: str) -> bool:
    """A query parameter's name as sent (percent-encoded, any case) that carries a credential."""
    name = unquote_plus(name).lower()
    return name in SECRET_PARAMS or is_secret_name(name)


def is_secret_header(name: str) -> bool:
    """A (lower-case) header name whose value is a credential: listed, or by its words."""
    return name.encode() in SECRET_HEADERS or is_secret_name(name)


def secret_names(extra: tuple[str, ...]) -> frozenset[bytes]:
    return SECRET_HEADERS | {h.lower().encode() for h in extra}


_COOKIES = frozenset({b"cookie", b"set-cookie"})
#: The shortest cookie value masked on its own: session ids are long, settings are words.
_COOKIE_VALUE = 12


def redact(
    message: str, headers: Sequence[tuple[bytes, bytes]], secret: frozenset[bytes], query: str = ""
) -> str:
    """Upstreams sometimes echo credentials in error text: mask every secret header's value
    (`secret`, or a name with a credential's word in it: `x-goog-api-key`), the token after
    a scheme such as `Bearer`, each cookie's value, a key offered as a WebSocket
    subprotocol, and the value of every query parameter that carries one (`?key=`,
    `?access_token=`), raw and percent-decoded. Runs only on error messages."""
    return mask_values(message, sent_credentials(headers, secret, query))


def sent_credentials(
    headers: Sequence[tuple[bytes, bytes]], secret: frozenset[bytes], query: str = ""
) -> list[str]:
    """The credentials among what a request sent, each as it may be echoed (`redact`'s)."""
    values: list[str] = []
    for header, raw in headers:
        text = raw.decode("latin-1")
        if header in secret or is_secret_name(header.decode("latin-1")):
            values += (text, text.partition(" ")[2])
            if header in _COOKIES:  # each cookie's value, which an upstream may echo alone
                # (a session id's length: not `theme=dark` nor `consent=true`)
                cookies = (pair.partition("=")[2].strip() for pair in text.split(";"))
                values += (value for value in cookies if len(value) >= _COOKIE_VALUE)
        elif header == b"sec-websocket-protocol":
            # a browser's realtime client sends its key as `openai-insecure-api-key.<key>`
            for offered in text.split(","):
                name, dot, value = offered.strip().partition(".")
                if dot and is_secret_name(name.lower()):
                    values.append(value)
    return values + _param_values(query)


def _param_values(query: str) -> list[str]:
    """The values of `query`'s parameters that carry a credential, raw and percent-decoded."""
    values: list[str] = []
    for pair in query.split("&") if query else ():
        param, _, value = pair.partition("=")
        if is_secret_param(param):
            values += (value, unquote_plus(value))
    return values


def mask_values(message: str, values: Iterable[str]) -> str:
    """`message` with each of `values` (credentials known beforehand) masked wherever it
    appears, whatever the shape of the text around it. A value under 4 characters is left:
    masking it would mask ordinary words."""
    for value in sorted(set(values), key=len, reverse=True):  # a value before its own parts
        if len(value) >= 4:
            message = message.replace(value, "[redacted]")
    return message


#: What a credential in a shown URL becomes.
MASK = "***"


def masked_url(url: str) -> str:
    """`url` fit to show: its user info masked whole (`http://***@host`: a name alone can be
    a token), and the value of each query parameter that carries a credential (`?api_key=***`;
    a fragment's too, where OAuth's implicit grant puts `#access_token=`); the rest kept.
    Any text is taken, a malformed URL too (a refusal shows what was refused). The user info
    runs from the `//` (else from the start) to the last `@`: a password may hold `@ / ? #`,
    each of which ends the authority for urllib, so a path or query holding an `@` masks
    more than the user info, which only hides more."""
    start, at = _userinfo(url)
    if at >= start:
        url = url[:start] + MASK + url[at:]
        start += len(MASK) + 1
    marks = [i for i in (url.find("?", start), url.find("#", start)) if i >= 0]
    head, rest = (url[: min(marks)], url[min(marks) :]) if marks else (url, "")
    if rest.startswith("?"):
        query, mark, fragment = rest[1:].partition("#")
        head += "?" + masked_query(query)
    else:
        mark, fragment = rest[:1], rest[1:]
    return head + mark + (masked_query(fragment) if mark else "")


def masked_query(query: str) -> str:
    """`query` (what follows a `?`) with the value of each parameter that carries a
    credential masked (`model=m&api_key=***`), every other parameter as it was."""
    return "&".join(_masked_pair(pair) for pair in query.split("&"))


def _masked_pair(pair: str) -> str:
    name, eq, _ = pair.partition("=")
    return f"{name}={MASK}" if eq and is_secret_param(name) else pair


def url_credentials(url: str) -> list[str]:
    """The credentials `url` carries, as a library that was given it may write them in its
    own words (`url: /v1/traces?api-key=...`, `'https://user:pass@...'`): its user info
    (whole, and its name and password apart, raw and percent-decoded; read as `masked_url`
    reads it) and its credential parameters' values (query and fragment). For `mask_values`."""
    values: list[str] = []
    start, at = _userinfo(url)
    if at >= start:
        userinfo = url[start:at]
        name, _, password = userinfo.partition(":")
        values += (userinfo, name, password, unquote(name), unquote(password))
        url = url[at + 1 :]
    before, _, fragment = url.partition("#")
    return values + _param_values(before.partition("?")[2]) + _param_values(fragment)


def _userinfo(url: str) -> tuple[int, int]:
    """Where `url`'s user info starts and its `@` is (`masked_url`'s reading); no user info
    when the `@` is before the start (-1: none)."""
    start = url.find("//")
    return (0 if start < 0 else start + 2), url.rfind("@")
