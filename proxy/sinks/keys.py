"""Per-API-key attribution without the keys: a short salted hash, bounded like models.

The label is the first 12 hex digits of SHA-256(salt + key). With a random per-process
salt (the default) nobody can test a guessed key against the label; a fixed `--key-salt`
keeps labels stable across restarts and workers. Only the first MAX_KEYS distinct keys get
a label of their own; later ones share `other`, so a flood of made-up keys cannot grow the
number of series.
"""

from __future__ import annotations

import hashlib
import secrets

OTHER = "other"
NO_KEY = "none"
MAX_KEYS = 100


class KeyLabels:
    def __init__(self, salt: str | None = None, max_keys: int = MAX_KEYS) -> None:
        self._salt = (salt if salt is not None else secrets.token_hex(16)).encode()
        self._max = max_keys
        self._labels: dict[bytes, str] = {}

    def __call__(self, headers: list[tuple[bytes, bytes]]) -> str:
        key = _api_key(headers)
        if key is None:
            return NO_KEY
        label = self._labels.get(key)
        if label is None:
            if len(self._labels) >= self._max:
                return OTHER
            label = hashlib.sha256(self._salt + key).hexdigest()[:12]
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
