"""Per-API-key attribution without the keys: a short salted hash, bounded like models.

The label is the first 12 hex digits of SHA-256(salt + key). With a random salt (the
default: drawn at each start, once for all `--workers`) nobody can test a guessed key
against the label; a fixed `--key-salt` keeps labels stable across restarts too. Only the first MAX_KEYS distinct keys get
a label of their own; later ones share `other`, so a flood of made-up keys cannot grow the
number of series. With several workers the bound is theirs together (a `Ledger` of the
labels, as for --label-header), never MAX_KEYS each.
"""

from __future__ import annotations

import hashlib
import secrets

from proxy.core.labels import Admitted, Ledger

OTHER = "other"
NO_KEY = "none"
MAX_KEYS = 100


class KeyLabels:
    def __init__(
        self, salt: str | None = None, max_keys: int = MAX_KEYS, ledger: Ledger | None = None
    ) -> None:
        self._salt = (salt if salt is not None else secrets.token_hex(16)).encode()
        # The labels admitted, not the keys: a ledger shared with other workers holds
        # only what /metrics shows anyway.
        self._admitted = Admitted(max_keys, ledger)
        self._labels: dict[bytes, str] = {}  # the keys this process has labelled

    def __call__(self, headers: list[tuple[bytes, bytes]]) -> str:
        key = _api_key(headers)
        if key is None:
            return NO_KEY
        label = self._labels.get(key)
        if label is None:
            # Hashed even once the bound is full: another worker may have admitted it.
            label = hashlib.sha256(self._salt + key).hexdigest()[:12]
            if not self._admitted(label):
                return OTHER
            self._labels[key] = label
        return label


def _api_key(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" and token.strip() else value
        if name == b"api-key" or name == b"x-api-key":
            return value
    return None
