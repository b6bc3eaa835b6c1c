"""The serving process's own figures on /metrics, under the names every Prometheus client
library gives them (process_cpu_seconds_total, process_resident_memory_bytes, ...), so
that the usual dashboards and the alert TokenprobeOpenFilesNearLimit read them.

Not prometheus-client's ProcessCollector: it counts open descriptors by listing
/proc/self/fd, one directory entry a descriptor, on the event loop at every scrape: at
15,000 descriptors (7,500 streams) 6.6 ms here at best and 28 ms on average beside the
test suite, a stall of every stream at every scrape. Since Linux 6.2 the size stat(2)
reports for /proc/self/fd is the number of open descriptors (the kernel counts its
descriptor bitmap): the whole collection then takes 0.02 ms at 15,000. So that is read
instead, and on an older kernel, where it reads 0, process_open_fds is left out.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PROC = Path("/proc/self")


class ProcessFigures(Collector):
    def __init__(self, proc: Path = PROC) -> None:
        self._proc = proc
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._started = _start_time(proc)

    def collect(self) -> Iterator[Metric]:
        times = os.times()
        yield CounterMetricFamily(
            "process_cpu_seconds_total",
            "Total user and system CPU time spent in seconds.",
            value=times.user + times.system,
        )
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY:
            yield GaugeMetricFamily(
                "process_max_fds", "Maximum number of open file descriptors.", value=soft
            )
        count = open_fds(self._proc)
        if count is not None:
            yield GaugeMetricFamily(
                "process_open_fds", "Number of open file descriptors.", value=count
            )
        try:
            pages = (self._proc / "statm").read_bytes().split()
        except OSError:  # no /proc: not Linux
            return
        yield GaugeMetricFamily(
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes.",
            value=int(pages[0]) * self._page,
        )
        yield GaugeMetricFamily(
            "process_resident_memory_bytes",
            "Resident memory size in bytes.",
            value=int(pages[1]) * self._page,
        )
        if self._started is not None:
            yield GaugeMetricFamily(
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
                value=self._started,
            )


def open_fds(proc: Path = PROC) -> int | None:
    """The process's open descriptors, from the kernel's own count (Linux 6.2 or later);
    None where the kernel reports none (0) or there is no /proc."""
    try:
        count = os.stat(proc / "fd").st_size
    except OSError:
        return None
    return count or None


def _start_time(proc: Path) -> float | None:
    """When the process started, in Unix seconds: its start in clock ticks after boot
    (/proc/self/stat, field 22) plus the boot time (/proc/stat's btime)."""
    try:
        stat = (proc / "stat").read_bytes()
        ticks = int(stat[stat.rindex(b")") + 2 :].split()[19])
        boot = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_bytes().splitlines()
            if line.startswith(b"btime ")
        )
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")
