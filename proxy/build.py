"""Which build of the per-chunk path runs: compiled by mypyc, or the pure-Python source.

`setup.py` compiles `PER_CHUNK_MODULES` with mypyc when it can (a non-editable install
with a C compiler at hand); the same source is the fallback, so a machine without a
compiler installs and runs the same proxy, only slower per chunk. An editable install
always runs the source: a stale compiled module would otherwise shadow every edit.

setup.py reads this file by path (it runs before the package is importable), so nothing
here imports the package at module level.
"""

from __future__ import annotations

import importlib
from importlib.machinery import EXTENSION_SUFFIXES

#: The modules that run per relayed chunk or per event, as paths from the repository
#: root: SSE and NDJSON framing, the stream template, the usage stripper, the observer,
#: WebSocket frame decoding and the wire's upstream side.
PER_CHUNK_MODULES = (
    "proxy/core/sse.py",
    "proxy/core/ndjson.py",
    "proxy/core/template.py",
    "proxy/core/strip.py",
    "proxy/core/observe.py",
    "proxy/core/wsframes.py",
    "proxy/server/wire/upstream.py",
)


def module_names() -> list[str]:
    """PER_CHUNK_MODULES as module names (proxy.core.sse...)."""
    return [path.removesuffix(".py").replace("/", ".") for path in PER_CHUNK_MODULES]


def compiled_modules() -> list[str]:
    """The per-chunk modules this process imported from a compiled extension."""
    return [
        name
        for name in module_names()
        if (importlib.import_module(name).__file__ or "").endswith(tuple(EXTENSION_SUFFIXES))
    ]


def describe() -> str:
    """One line for the start of `tokenprobe serve` and `tokenprobe --version`."""
    done = len(compiled_modules())
    if done == len(PER_CHUNK_MODULES):
        return f"per-chunk path compiled (mypyc, {done} modules)"
    if done == 0:
        return "per-chunk path pure Python (no compiled build installed)"
    return f"per-chunk path partly compiled ({done} of {len(PER_CHUNK_MODULES)} modules)"
