"""Per-API-key attribution without the keys: a short salted hash, bounded like models.

The label is the first 12 hex digits of SHA-256(salt + key). With a random salt (the
default: drawn at each start, once for all `--workers`) nobody can test a guessed key
against the label; a fixed `--key-salt` keeps labels stable across restarts too.

Only the first MAX_KEYS distinct keys *the backend accepted* get a label of their own:
anyone who reaches the port can make up keys, so a key takes a place only once a request
carrying it was answered by the upstream and not refused for its credentials (`settle`),
on a route where the backend checks keys at all (`checks_keys`: vLLM checks only its
guarded prefixes, so a made-up key on its `/pooling` or `/score` is answered whatever it
is, and vouches for nothing).
A request whose new key was refused (401/403, or a body saying the key is bad:
proxy/core/errors.py) is `rejected`; one that got no answer, or came once the places were
taken, `other`. A flood of made-up keys therefore neither grows the number of series nor
takes the places of real keys. With several workers the bound is theirs together (a
`Ledger` of the labels, as for --label-header), never MAX_KEYS each.
"""

from __future__ import annotations

import hashlib
import secrets

from proxy.core.labels import Admitted, Ledger
from proxy.core.measurement import ErrorType, Measurement

OTHER = "other"
NO_KEY = "none"
REJECTED = "rejected"
MAX_KEYS = 100
#: The statuses that refuse a request's credentials, whatever else its record says.
_REFUSED = frozenset({401, 403})
#: A WebSocket session's turn (proxy/core/apis/realtime.py) is recorded with the status
#: of the upgrade the upstream took: it was answered, with no `ttfb` of its own.
_SWITCHED = 101
#: The paths vLLM checks API keys on (vllm/entrypoints/serve/middleware/authenticate.py
#: GUARDED_PREFIX, 0.32); every other route it answers whatever key came, none too.
VLLM_GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")


def checks_keys(kind: str, path: str) -> bool:
    """Whether a backend of `kind` (proxy/core/identity.py) checks the API key of a
    request to `path`, as far as the proxy knows: vLLM only under its guarded prefixes;
    any other (llama-server checks every route but its public ones, none of them
    measured: tools/server/server-http.cpp `public_endpoints`), and one not known, yes."""
    return kind != "vllm" or path.startswith(VLLM_GUARDED_PREFIX)


class KeyLabels:
    """A request's key label in two steps: `__call__` when it arrives, `settle` when it
    ends. A key already admitted has its label at once (a dict lookup); a new key's hash
    is only a candidate until `settle` sees how the backend answered."""

    def __init__(
        self, salt: str | None = None, max_keys: int = MAX_KEYS, ledger: Ledger | None = None
    ) -> None:
        self._salt = (salt if salt is not None else secrets.token_hex(16)).encode()
        # The labels admitted, not the keys: a ledger shared with other workers holds
        # only what /metrics shows anyway.
        self._admitted = Admitted(max_keys, ledger)
        # The keys this process has seen admitted (at most max_keys and the odd key
        # hashing alike): a made-up key is never kept.
        self._labels: dict[bytes, str] = {}

    def __call__(self, headers: list[tuple[bytes, bytes]], checked: bool = True) -> str:
        """`none` without a key; else the key's label, admitted or a candidate: no
        sink sees a candidate, `settle` turns it into what is recorded. `checked`: the
        backend checks the key of this request (`checks_keys`); where it does not, a key
        not admitted yet is `other`, never a candidate."""
        key = _api_key(headers)
        if key is None:
            return NO_KEY
        label = self._labels.get(key)
        if label is None:
            # Hashed each time until admitted, here or by another worker (`settle`).
            label = hashlib.sha256(self._salt + key).hexdigest()[:12]
            if label in self._admitted:
                self._labels[key] = label
            elif not checked:
                return OTHER
        return label

    def settle(self, label: str, m: Measurement) -> str:
        """The label `m` is recorded with, `label` being what `__call__` gave its request.
        An admitted label stays, the key's refusals included (a revoked key shows as
        error_type="auth" under its own label)."""
        if label in self._admitted or label in (NO_KEY, OTHER):
            return label
        if m.error_type is ErrorType.AUTH or m.status_code in _REFUSED:
            # (the status too: a client that left as the 401 came is client_cancelled,
            # and its made-up key was admitted) A key another worker admitted keeps its
            # label: the shared ledger is asked, read-only.
            return label if self._admitted.known(label) else REJECTED
        if m.ttfb is None and m.status_code != _SWITCHED:
            return OTHER  # no answer vouched for the key (unreachable, timed out, cut)
        return label if self._admitted(label) else OTHER


def _api_key(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The key the backend checks: `Authorization` wherever it stands (vLLM reads only its
    Bearer token, vllm/entrypoints/serve/middleware/authenticate.py `verify_token`;
    llama-server reads it first, tools/server/server-http.cpp), else `x-api-key` or
    `api-key` (llama-server's fallback when Authorization is absent). Taken in header
    order, a made-up `x-api-key` sent before a valid `Authorization` was labelled while
    the backend accepted the request for the other: one valid key admitted any number."""
    fallback = None
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" and token.strip() else value
        if fallback is None and (name == b"api-key" or name == b"x-api-key"):
            fallback = value
    return fallback
