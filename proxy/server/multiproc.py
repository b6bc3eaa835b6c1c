"""Several worker processes, one /metrics: prometheus-client's multiprocess mode.

Every worker writes its values to files in one directory (`PROMETHEUS_MULTIPROC_DIR`,
cleared of a previous run's files at start by `serve`); whichever worker answers a
scrape sums them all. Live gauges of workers that died are dropped at each scrape, or a
crashed worker's in-flight requests would stay in flight forever.

Who writes there now is the kernel's to say: every process writing metrics to the
directory holds a shared flock on the directory itself for as long as it lives (the
kernel drops it when the process ends, however it ends), and a start takes it alone
before it clears anything (`fresh_metrics_directory`), one start at a time
(`_one_start_at_a_time`). A pid in a file's name says only
who wrote it once: the pid of a previous run's worker may belong to any process now (a
restarted container numbers its processes from 1 again).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from proxy.server.exposition import Exposition
from proxy.server.ledger import PREFIX as LEDGER_PREFIX
from proxy.settings import SettingsError

log = logging.getLogger("tokenprobe")

#: Where the workers' metric files go (prometheus-client reads the same variable).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


#: The in-flight gauges whose values a dead worker leaves behind are its lost requests
#: and its lost WebSocket sessions.
IN_FLIGHT = "tokenprobe_requests_in_flight"
WS_IN_FLIGHT = "tokenprobe_websocket_sessions_in_flight"

#: Called with (model, endpoint, requests) for the requests a dead worker had in flight.
Lost = Callable[[str, str, float], None]
#: Called with (route, sessions) for the WebSocket sessions a dead worker had open.
SessionsLost = Callable[[str, float], None]


def multiprocess_metrics_app(
    directory: str, lost: Lost | None = None, sessions_lost: SessionsLost | None = None
) -> Exposition:
    writing_to(directory)  # each worker builds its exposition: it writes metrics there
    # The collector describes no names: without this a `name[]` scrape would leave it out.
    scrape_registry = CollectorRegistry(support_collectors_without_names=True)
    scrape_registry.register(WrittenFiles(directory))
    return Exposition(
        scrape_registry, before=lambda: drop_dead_workers(directory, lost, sessions_lost)
    )


class WrittenFiles:
    """prometheus-client's MultiProcessCollector, without the files a worker is creating at
    that moment. A worker opens a new file, then gives it its size (`MmapedDict`): the
    collector read a file caught in between as a corrupt one (`struct.error`), and the
    scrape answered 500. It was seen in a full test run, where a worker that made a file
    at its first request was paused between the two. An empty file holds no value yet,
    so the sum without it is the sum as it stands."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def collect(self) -> Iterable[Metric]:
        from prometheus_client.multiprocess import MultiProcessCollector

        files = glob.glob(os.path.join(self.directory, "*.db"))
        written = [path for path in files if _size(path) > 0]
        return MultiProcessCollector.merge(written, accumulate=True)  # type: ignore[no-any-return,no-untyped-call]


def _size(path: str) -> int:
    """0 for a file gone since the listing: a dead worker's live gauges, dropped."""
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


_PID = re.compile(r"_(\d+)\.db$")
_CLAIMED = re.compile(r"_\d+\.db\.\d+\.claimed$")  # `_count_lost`'s, left by a crash


def drop_dead_workers(
    directory: str, lost: Lost | None = None, sessions_lost: SessionsLost | None = None
) -> None:
    """Remove live-gauge files of worker processes that no longer exist; the requests and
    WebSocket sessions such a worker had in flight died with it (their clients'
    connections were cut, no record was written), and go to `lost` and `sessions_lost`
    once, whichever worker scrapes first."""
    dead = set()
    for path in glob.glob(os.path.join(directory, "gauge_live*_*.db")):
        match = _PID.search(path)
        if match is not None and _gone(directory, pid := int(match.group(1))):
            dead.add(pid)
    for pid in dead:  # its in-flight values read before its live gauges all go
        if lost is not None or sessions_lost is not None:
            path = os.path.join(directory, f"gauge_livesum_{pid}.db")
            _count_lost(path, lost, sessions_lost)
        _mark_dead(pid, directory)


def fresh_metrics_directory(directory: str) -> None:
    """The metrics directory `serve` starts with, made if missing, and cleared of a previous
    run's files (their counters would be summed in): prometheus-client's and the label
    ledgers, nothing else. The directory stays, for it may be a mount point (a Kubernetes
    emptyDir), which cannot be removed, and other files in it are not ours. This process
    then holds it as its writer until it ends (`writing_to`).

    SettingsError when it cannot be a directory, or when a live process writes metrics
    there: another proxy given the same directory, whose counters clearing would send back
    to 0, and which would report this one's traffic as its own; or when another start
    on it has held the start lock for longer than `START_WAIT`."""
    try:
        os.makedirs(directory, exist_ok=True)
        with _one_start_at_a_time(directory) as no_flock:
            if no_flock is None:
                _take_alone_and_clear(directory)
            else:
                _unguarded(directory, no_flock)
    except OSError as exc:
        raise SettingsError(f"{MULTIPROC_ENV}={directory!r}: {exc.strerror}") from None


def _take_alone_and_clear(directory: str) -> None:
    """Clear the directory with its flock held alone, then hold it shared, beside the
    workers'. Called only inside `_one_start_at_a_time`: the change from alone to shared
    is not one step (flock(2)), and only the start lock keeps a second start out of it."""
    held = os.path.realpath(directory) in _HELD
    fd = _hold(directory)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        writer = _lock_holder(fd)
        _let_go(directory, fd, held)
        who = "another process is" if writer is None else f"process {writer} is"
        raise SettingsError(
            f"{MULTIPROC_ENV}={directory!r}: {who} writing its metrics there; "
            "give each tokenprobe serve a directory of its own"
        ) from None
    except OSError as exc:
        if exc.errno not in _NO_FLOCK:
            raise
        _unguarded(directory, exc.strerror)
        return
    _clear_run_files(directory)
    fcntl.flock(fd, fcntl.LOCK_SH)


def _unguarded(directory: str, why: str | None) -> None:
    """A filesystem without flock (some network ones): the start goes on, unguarded."""
    log.warning(
        "%s=%r: cannot lock it (%s): a second proxy given it would not be refused",
        MULTIPROC_ENV,
        directory,
        why,
    )
    _clear_run_files(directory)


#: The start lock: a file in the directory that each start holds a flock on, alone, from
#: before it looks at the directory's flock until it holds that shared. There only while
#: a start runs.
START_LOCK = "tokenprobe-starting"

#: How long a start waits for another's start lock before it is refused. A start holds it
#: for milliseconds; one that holds it for seconds is stopped (^Z, a debugger) or clearing
#: a directory of very many files, and waiting on it without a bound left this start hung
#: and silent for as long. Refused, it names the holder; had it waited, the holder would
#: most likely have held the directory by then, and refused it all the same.
START_WAIT = 3.0


@contextlib.contextmanager
def _one_start_at_a_time(directory: str) -> Iterator[str | None]:
    """Starts on `directory` one after the other. A start changes the directory's flock
    from alone to shared in two steps (flock(2): "the existing lock is first removed, and
    then a new lock is established"): a second start between the two found the directory
    free, cleared the first's files and wrote beside it, both started. Holding the start
    lock it waits until the first holds the directory shared, and is refused.

    It waits `START_WAIT` at most, trying the lock without blocking, then is refused
    (SettingsError) naming the process that holds it.

    Yields None, or on a filesystem without flock why it cannot lock. The file goes before
    its lock does, so a directory between runs holds nothing of ours; a start that waited
    on a file removed meanwhile takes the one there now (a lock on a removed file keeps
    out no one)."""
    path = os.path.join(directory, START_LOCK)
    deadline = time.monotonic() + START_WAIT
    pause = 0.001  # doubled up to 50 ms: a race's loser gets in a millisecond after
    while True:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() >= deadline:
                holder = _lock_holder(fd)
                os.close(fd)
                raise _another_start(directory, holder) from None
            os.close(fd)
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
            continue
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            if exc.errno not in _NO_FLOCK:
                raise
            yield exc.strerror
            return
        if _names(path, fd):
            break
        os.close(fd)
    try:
        yield None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        os.close(fd)


def _another_start(directory: str, holder: int | None) -> SettingsError:
    who = "another process" if holder is None else f"process {holder}"
    return SettingsError(
        f"{MULTIPROC_ENV}={directory!r}: {who} has been starting on it for over "
        f"{START_WAIT:g} s (it holds {START_LOCK}: stopped, or clearing very many files); "
        "give each tokenprobe serve a directory of its own"
    )


def _names(path: str, fd: int) -> bool:
    """Whether `path` is still the file open as `fd` (not removed, nor made anew)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


#: flock's errors on a filesystem that has none (flock(2): ENOLCK, EOPNOTSUPP; EINVAL
#: where the file system cannot lock this kind of file).
_NO_FLOCK = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS})


#: This process's hold on each metrics directory it writes to, by real path: a
#: descriptor of the directory with a flock on it, open until the process ends.
_HELD: dict[str, int] = {}


def writing_to(directory: str) -> None:
    """This process writes metrics to `directory` from now on: it holds the directory's
    flock, shared, until it ends, so that no start clears the files under it (it waits
    out a start that holds it alone to clear it). Again for the same directory: nothing."""
    try:
        fcntl.flock(_hold(directory), fcntl.LOCK_SH)
        _mark_live(directory)
    except OSError as exc:
        if exc.errno not in _NO_FLOCK:
            raise  # (fresh_metrics_directory has warned: the start went on unguarded)


#: A worker's live mark: a file it holds a flock on for as long as it lives, which tells
#: its end from its pid's reuse (drop_dead_workers).
LIVE_PREFIX = "tokenprobe-live-"
#: This process's live marks, by directory's real path: open until the process ends.
_MARKS: dict[str, int] = {}


def _mark_live(directory: str) -> None:
    key = os.path.realpath(directory)
    if key not in _MARKS:
        path = os.path.join(directory, f"{LIVE_PREFIX}{os.getpid()}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)  # a dead namesake's mark: nobody holds it
        _MARKS[key] = fd


def _gone(directory: str, pid: int) -> bool:
    """Whether the worker that wrote `pid`'s files has ended: its live mark is held by
    nobody (the kernel dropped the flock as it ended), whatever process has its pid now
    (a restarted container numbers its processes from 1 again). A writer without a mark
    (one that never built its exposition, or a filesystem without flock): no process with
    that pid."""
    try:
        fd = os.open(os.path.join(directory, f"{LIVE_PREFIX}{pid}"), os.O_RDONLY)
    except FileNotFoundError:
        return not _alive(pid)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # held: its writer lives (this process's own mark included)
    except OSError:
        return not _alive(pid)
    finally:
        os.close(fd)  # (and with it the lock just taken)
    return True


def _hold(directory: str) -> int:
    """This process's descriptor of `directory`, opened once (not inherited by children:
    each worker holds its own)."""
    key = os.path.realpath(directory)
    fd = _HELD.get(key)
    if fd is None:
        fd = _HELD[key] = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    return fd


def _let_go(directory: str, fd: int, held: bool) -> None:
    """After a refused start: a failed change of lock has dropped this process's own
    (flock(2)), so a directory it wrote to before is held again, shared; one it had not
    is closed."""
    if held:
        fcntl.flock(fd, fcntl.LOCK_SH)
    else:
        del _HELD[os.path.realpath(directory)]
        os.close(fd)


def _lock_holder(fd: int) -> int | None:
    """A process other than this one holding a flock on `fd`'s file, from /proc/locks
    (Linux: `1: FLOCK  ADVISORY  READ  <pid> <major>:<minor>:<inode> 0 EOF`), for the
    refusal to name; None where that cannot be read (another system, or a holder in
    another pid namespace: pid 0)."""
    st = os.fstat(fd)
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as locks:
            for line in locks:
                fields = line.split()
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == where:
                    pid = int(fields[4])
                    if pid not in (0, os.getpid()):
                        return pid
    except (OSError, ValueError):
        pass
    return None


def _clear_run_files(directory: str) -> None:
    """Remove a run's files from `directory`: prometheus-client's (`<kind>_<pid>.db`, a
    claimed one too), the label ledgers (proxy/server/ledger.py) and the workers' live
    marks. Nothing else there is ours."""
    for name in os.listdir(directory):
        if (
            _PID.search(name)
            or _CLAIMED.search(name)
            or name.startswith((LEDGER_PREFIX, LIVE_PREFIX))
        ):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(directory, name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _mark_dead(pid: int, directory: str) -> None:
    """prometheus-client's `mark_process_dead`, for two workers answering scrapes at once:
    each removes the dead worker's live gauge files, and a file the other removed first
    is gone, not an error (its `os.remove` raised, and the scrape answered 500)."""
    for path in glob.glob(os.path.join(directory, f"gauge_live*_{pid}.db")):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(directory, f"{LIVE_PREFIX}{pid}"))


def _count_lost(path: str, lost: Lost | None, sessions_lost: SessionsLost | None) -> None:
    """The in-flight values in a dead worker's file. The file is claimed by renaming it
    first: of two workers answering scrapes at once, one counts it."""
    from prometheus_client.mmap_dict import MmapedDict

    claimed = f"{path}.{os.getpid()}.claimed"
    try:
        os.rename(path, claimed)
    except FileNotFoundError:
        return  # another worker claimed it, or the worker had none
    try:
        values = MmapedDict(claimed, read_mode=True)  # type: ignore[no-untyped-call]
        try:
            for key, value, _ in values.read_all_values():  # type: ignore[no-untyped-call]
                name, _, labels, _ = json.loads(key)
                if value <= 0:
                    continue
                if name == IN_FLIGHT and lost is not None:
                    lost(labels.get("model", ""), labels.get("endpoint", ""), value)
                elif name == WS_IN_FLIGHT and sessions_lost is not None:
                    sessions_lost(labels.get("route", ""), value)
        finally:
            values.close()  # type: ignore[no-untyped-call]
    except Exception:  # a file the worker died writing: the scrape goes on without it
        log.exception("reading a dead worker's in-flight requests failed")
    finally:
        os.remove(claimed)
