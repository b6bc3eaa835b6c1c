"""Per-API-key attribution without the keys: a short salted hash, bounded like models.

The label is the first 12 hex digits of SHA-256(salt + key). With a random salt (the
default: drawn at each start, once for all `--workers`) nobody can test a guessed key
against the label; a fixed `--key-salt` keeps labels stable across restarts too.

Only the first MAX_KEYS distinct keys *the backend accepted* get a label of their own:
anyone who reaches the port can make up keys, so a key takes a place only once a request
carrying it was answered by the upstream and not refused for its credentials (`settle`).
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

    def __call__(self, headers: list[tuple[bytes, bytes]]) -> str:
        """`none` without a key; else the key's label, admitted or a candidate: no
        sink sees a candidate, `settle` turns it into what is recorded."""
        key = _api_key(headers)
        if key is None:
            return NO_KEY
        label = self._labels.get(key)
        if label is None:
            # Hashed each time until admitted, here or by another worker (`settle`).
            label = hashlib.sha256(self._salt + key).hexdigest()[:12]
            if label in self._admitted:
                self._labels[key] = label
        return label

    def settle(self, label: str, m: Measurement) -> str:
        """The label `m` is recorded with, `label` being what `__call__` gave its request.
        An admitted label stays, the key's refusals included (a revoked key shows as
        error_type="auth" under its own label)."""
        if label in self._admitted or label == NO_KEY:
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
