"""Keep the garbage collector's full collections short in a serving process.

A full (generation 2) collection walks every object the collector tracks, and a proxy
process holds a few hundred thousand of them from its imports and its assembly alone
(starlette, httpx, prometheus-client, opentelemetry, the tokenizer): each such collection
stopped every stream for 20-48 ms (measured with gc.callbacks in `tokenprobe serve` under
50 concurrent /metrics scrapes, which allocate enough to trigger them). Those objects live
as long as the process, so once startup is done they are moved out of the collector's
sight (`gc.freeze`, CPython's tool for this) and a full collection walks only what came
after: label sets, pooled connections, requests in flight.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect what startup left as garbage, then freeze the rest (call once, at the end of
    the serving process's startup)."""
    gc.collect()
    gc.freeze()
