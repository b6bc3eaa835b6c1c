"""What every bench command shares to run: the event loop (uvloop when installed) and the
local tokenizer behind `--tokenizer`."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

from proxy.bench.options import OptionsError
from proxy.core import extras

T = TypeVar("T")


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def tokenizer(path: str | None) -> Any:
    """The tokenizer in directory `path` (None without one); OptionsError when it cannot load."""
    if not path:
        return None
    if extras.missing("transformers"):  # say which extra, as `tokenprobe serve` does
        raise OptionsError(
            f"--tokenizer {path}: " + extras.needs("the tokenizer", "transformers", "tokenizer")
        )
    # transformers warns on import that PyTorch is missing; a tokenizer needs no PyTorch.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from proxy.core.tokens import load_tokenizer

    try:
        return load_tokenizer(path)
    except Exception as exc:  # transformers raises many kinds
        raise OptionsError(f"--tokenizer: cannot load {path}: {exc}") from None
