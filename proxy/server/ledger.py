"""The label bounds the worker processes share: one small file per bounded label.

`--label-values N` and the API keys' bound are meant for the metrics, and with
`--workers` (PROMETHEUS_MULTIPROC_DIR) the metrics are every worker's files summed,
a dead worker's included. Each process admitting its own first N let the workers
together show N per worker, and N more for every restarted worker. So the admitted
values live beside those files, in `tokenprobe-admitted-<label>`: one value a line, in
the order admitted, read and appended under an exclusive lock (flock), so that two
workers admitting at once cannot both take the last place.

A process reads the file only for a value it has not admitted yet, and only until the
file is full (proxy/core/labels.py `Admitted`): at most N + 1 times a label, each a
read of at most N short lines. `serve` clears the files with the metrics at start.
"""

from __future__ import annotations

import fcntl
import logging
import os

log = logging.getLogger("tokenprobe")

#: The files' names begin with this (what `serve` clears at start, with the metrics).
PREFIX = "tokenprobe-admitted-"


def ledger_path(directory: str, label: str) -> str:
    """The file of one label (a label name is `[a-zA-Z_][a-zA-Z0-9_]*`, and unique)."""
    return os.path.join(directory, PREFIX + label)


class FileLedger:
    """The values admitted to one label by every process writing to one directory."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._warned = False

    def admit(self, value: str, limit: int) -> frozenset[str] | None:
        """Append `value` if fewer than `limit` are kept; the values kept, after. The
        values are label values (plain characters, no line break: `sanitise`, a hash)."""
        try:
            with open(self.path, "a+b") as file:
                fcntl.flock(file, fcntl.LOCK_EX)  # released when the file closes
                file.seek(0)
                # whole lines only: each value is appended in one write, with its end
                kept = frozenset(file.read().decode().split("\n")[:-1])
                if value in kept or len(kept) >= limit:
                    return kept
                file.write(value.encode() + b"\n")
                file.flush()
                return kept | {value}
        except OSError as exc:
            if not self._warned:  # once: this runs for each new value of a request
                self._warned = True
                log.warning("cannot share the label bound in %s (%s)", self.path, exc)
            return None
