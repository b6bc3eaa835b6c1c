"""`--label-values N` and the API keys' bound hold for all workers together: the processes
that sum their metrics (`--workers`, PROMETHEUS_MULTIPROC_DIR) admit values through one
ledger in the metrics directory (proxy/server/ledger.py). Each process admitted its own
first N, and every restarted worker N fresh ones, while the dead one's files stayed in
the sum. Here the workers are admitters sharing one directory, as the processes do."""

from __future__ import annotations

import random
import threading
from pathlib import Path

from prometheus_client import CollectorRegistry

from proxy.core.labels import HeaderLabels
from proxy.server.assemble import assemble
from proxy.server.ledger import FileLedger, ledger_path
from proxy.settings import Settings
from proxy.sinks.keys import KeyLabels
from tests.factories import measurement
from tests.server.conftest import no_proxy

pytestmark = no_proxy

N = 3


def worker(directory: Path, limit: int = N) -> HeaderLabels:
    """One worker's `--label-header x-team=team` resolver."""
    return HeaderLabels(("x-team",), limit, (FileLedger(ledger_path(str(directory), "team")),))


def team(labels: HeaderLabels, value: str) -> str:
    return labels([(b"x-team", value.encode())])[0]


def test_two_workers_admit_n_values_together_not_n_each(tmp_path: Path) -> None:
    a, b = worker(tmp_path), worker(tmp_path)
    assert [team(a, v) for v in ("t0", "t1")] == ["t0", "t1"]
    assert [team(b, v) for v in ("t2", "t3", "t1")] == ["t2", "other", "t1"]
    assert [team(a, v) for v in ("t2", "t4", "t0")] == ["t2", "other", "t0"]


def test_a_restarted_worker_admits_no_fresh_set(tmp_path: Path) -> None:
    first = worker(tmp_path)
    assert [team(first, f"t{i}") for i in range(N)] == ["t0", "t1", "t2"]
    restarted = worker(tmp_path)  # the dead one's files stay in the sum, so does its share
    assert [team(restarted, v) for v in ("new", "t1", "newer")] == ["other", "t1", "other"]


def test_workers_in_any_order_never_admit_more_than_n_in_all(tmp_path: Path) -> None:
    rng = random.Random(7)
    workers = [worker(tmp_path) for _ in range(4)]
    seen: set[str] = set()
    for _ in range(300):
        if rng.random() < 0.05:  # a worker dies and another takes its place
            workers[rng.randrange(len(workers))] = worker(tmp_path)
        label = team(rng.choice(workers), f"t{rng.randrange(40)}")
        seen.add(label)
    assert len(seen - {"other"}) == N


def test_workers_admitting_at_once_cannot_both_take_the_last_place(tmp_path: Path) -> None:
    start = threading.Barrier(8)
    admitted: list[str] = []

    def run(i: int) -> None:
        labels = worker(tmp_path)  # a file of its own open: flock is per open file
        start.wait()
        for j in range(5):
            if (label := team(labels, f"w{i}-{j}")) != "other":
                admitted.append(label)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(admitted) == N


def test_once_the_bound_is_full_a_new_value_reads_no_file(tmp_path: Path) -> None:
    """The ledger is asked for a value not admitted here yet, until it is full (N + 1
    times at most): after that a new value is `other` by a set lookup, as in one process."""

    class Counting(FileLedger):
        asked = 0

        def admit(self, value: str, limit: int) -> frozenset[str] | None:
            Counting.asked += 1
            return super().admit(value, limit)

    other = worker(tmp_path)
    for i in range(N):
        team(other, f"t{i}")
    labels = HeaderLabels(("x-team",), N, (Counting(ledger_path(str(tmp_path), "team")),))
    assert [team(labels, v) for v in ("t0", "x", "y", "z", "t2")] == [
        *("t0", "other", "other", "other", "t2")
    ]
    assert Counting.asked == 1  # its first value brought every admitted one


def test_api_keys_are_bounded_for_all_workers_together(tmp_path: Path) -> None:
    def keys() -> KeyLabels:
        return KeyLabels("salt", max_keys=2, ledger=FileLedger(ledger_path(str(tmp_path), "key")))

    def key(labels: KeyLabels, token: str) -> str:
        """The label of a request with `token` the backend accepted."""
        return labels.settle(
            labels([(b"authorization", f"Bearer {token}".encode())]), measurement()
        )

    a, b = keys(), keys()
    first = key(a, "sk-1")
    assert first not in ("other", "none") and key(b, "sk-2") not in ("other", "none")
    assert key(b, "sk-3") == "other" and key(a, "sk-4") == "other"
    assert key(b, "sk-1") == first  # admitted by the other worker: its label here too
    assert key(keys(), "sk-5") == "other"  # a restarted worker
    assert "sk-" not in (tmp_path / "tokenprobe-admitted-key").read_text()  # labels, no keys


def test_the_proxy_shares_its_bounds_only_in_multiprocess_mode(tmp_path: Path) -> None:
    """assemble gives each process a ledger in PROMETHEUS_MULTIPROC_DIR; a process of its
    own keeps its bounds to itself, with no file."""
    settings = Settings(
        upstream="http://127.0.0.1:9",
        label_header=("x-team=team",),
        label_values=2,
        key_label="hash",
        key_salt="s",
    )
    environ = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    apps = [assemble(settings, environ, registry=CollectorRegistry()) for _ in range(2)]
    resolvers = [app.sinks.header_labels for app in apps]
    assert resolvers[0] is not None and resolvers[1] is not None
    assert [team(resolvers[0], v) for v in ("a", "b")] == ["a", "b"]
    assert team(resolvers[1], "c") == "other"
    keys = apps[0].sinks.keys
    assert keys is not None
    label = keys.settle(keys([(b"api-key", b"k1")]), measurement())  # an accepted key
    assert label in (tmp_path / "tokenprobe-admitted-key").read_text()
    alone = assemble(settings, {}, registry=CollectorRegistry()).sinks.header_labels
    assert alone is not None and [team(alone, v) for v in ("c", "d", "e")] == ["c", "d", "other"]
