"""The simulator's prefix cache: cached prompt tokens for a prompt that repeats an earlier one.

A model of vLLM's automatic prefix caching, at the granularity that matters to a proxy:
the longest run of leading messages this prompt shares with a prompt seen before (a
conversation's next turn repeats all of its previous one) is "cached", counted in the
simulator's own prompt tokens (proxy/sim/tokens.py: ceil(characters / 4)) and rounded
down to whole blocks of `block` tokens, as vLLM caches only full KV blocks
(vllm/v1/core/kv_cache_utils.py hashes a request's tokens per full block). Units are a
system or instructions text first, then each message (chat, Messages) or input item
(Responses); a text prompt (completions) has none and is never cached.

Bounded: at most `capacity` prefixes are remembered, the oldest used dropped first (an
evicted prefix is a miss, as on a real server under memory pressure).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from typing import Any

import orjson

from proxy.sim.tokens import content_chars


class PrefixCache:
    def __init__(self, capacity: int, block: int = 16) -> None:
        if capacity < 1 or block < 1:
            raise ValueError("prefix cache capacity and block must be >= 1")
        self.capacity, self.block = capacity, block
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def cached_tokens(self, body: dict[str, Any]) -> int:
        """The prompt's cached tokens, and its prefixes remembered for later requests."""
        units = _units(body)
        h = hashlib.blake2b(digest_size=16)
        chars = 0
        shared = 0
        for unit, unit_chars in units:
            h.update(unit)
            h.update(b"\x1e")
            digest = h.copy().digest()
            chars += unit_chars
            if digest in self._seen:
                self._seen.move_to_end(digest)
                shared = chars
            else:
                self._seen[digest] = None
                if len(self._seen) > self.capacity:
                    self._seen.popitem(last=False)
        tokens = math.ceil(shared / 4)
        return tokens - tokens % self.block


def _units(body: dict[str, Any]) -> list[tuple[bytes, int]]:
    units: list[tuple[bytes, int]] = []
    for field in ("system", "instructions"):
        text = body.get(field)
        if text:
            units.append((orjson.dumps(text), content_chars(text)))
    items = body.get("messages", body.get("input"))
    if isinstance(items, list):
        for item in items:
            if isinstance(item, dict):
                units.append((orjson.dumps(item), content_chars(item.get("content"))))
            else:
                break  # token ids or texts: no messages to share
    return units
