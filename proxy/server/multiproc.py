"""Several worker processes, one /metrics: prometheus-client's multiprocess mode.

Every worker writes its values to files in one directory (`PROMETHEUS_MULTIPROC_DIR`,
wiped at start by `serve`); whichever worker answers a scrape sums them all. Live gauges
of workers that died are dropped at each scrape, or a crashed worker's in-flight
requests would stay in flight forever.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any

from prometheus_client import CollectorRegistry

from proxy.server.exposition import Exposition

#: Where the workers' metric files go (prometheus-client reads the same variable).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_metrics_app(directory: str) -> Any:
    from prometheus_client import multiprocess

    # The collector describes no names: without this a `name[]` scrape would leave it out.
    scrape_registry = CollectorRegistry(support_collectors_without_names=True)
    multiprocess.MultiProcessCollector(scrape_registry, path=directory)  # type: ignore[no-untyped-call]
    return Exposition(scrape_registry, before=lambda: drop_dead_workers(directory))


_PID = re.compile(r"_(\d+)\.db$")


def drop_dead_workers(directory: str) -> None:
    """Remove live-gauge files of worker processes that no longer exist."""
    from prometheus_client import multiprocess

    for path in glob.glob(os.path.join(directory, "gauge_live*_*.db")):
        match = _PID.search(path)
        if match is None:
            continue
        pid = int(match.group(1))
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            multiprocess.mark_process_dead(pid, directory)  # type: ignore[no-untyped-call]
        except PermissionError:
            pass
