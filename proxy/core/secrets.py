"""Credentials: which header and parameter names carry them, and masking them in the error
text an upstream echoes (the only text of a request's that the proxy logs, traces and
records). Shared by the relays, the tunnel and the bench: every path that reports an
upstream's words masks the same things."""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import unquote_plus

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
    for pair in query.split("&") if query else ():
        param, _, value = pair.partition("=")
        param = unquote_plus(param).lower()
        if param in SECRET_PARAMS or is_secret_name(param):
            values += (value, unquote_plus(value))
    for value in sorted(values, key=len, reverse=True):  # a value before its own parts
        if len(value) >= 4:
            message = message.replace(value, "[redacted]")
    return message
