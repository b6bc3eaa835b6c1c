"""Multi-process lockstep benchmark: many emitters, many clients, proxies with N workers.

Several emitter processes (`emitter.py`) share the backend port through SO_REUSEPORT and
tick on one wall-clock grid, so every stream gets one chunk per decode step, each stamped
with its send time. Several load-generator processes (`loadgen.py`) split the streams and
time each chunk's arrival, so per-chunk latency is exact across processes. The arms:

  direct                    clients -> emitters (the baseline "added" subtracts)
  nginx xN                  N worker processes accepting from one shared socket
  nginx-reuseport xN        N workers, `listen ... reuseport`: one socket per worker
  tokenprobe xN             `tokenprobe serve --workers N` (uvicorn: one shared socket)
  tokenprobe-reuseport xN   N `reuseport_worker.py` processes, one SO_REUSEPORT socket each

Arms run interleaved in rounds (order rotated), all started once before the first round.
Per arm and stream count: chunks delivered of expected, added p50/p99 per chunk against
direct in the same round, the cores the arm used (CPU / wall), CPU µs per chunk, and how
evenly its worker processes shared the work (cores of the busiest and idlest worker).

The arm gets `--arm-cores` cores (default half, at least 1) and the emitters and clients
the rest, so it runs on any core count; on 2 cores every multi-worker arm shares one core,
which measures what N workers cost there, not how they scale.

    .venv/bin/python benchmarks/multiproc.py --quick                  # ~2 min on 2 cores
    .venv/bin/python benchmarks/multiproc.py --streams 256,1024 --workers 1,4,8 \\
        --emitters 4 --clients 4 --out mp.json --md mp.md             # a many-core machine
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arms.stack import NGINX, NGINX_CONF
from harness.procs import (
    HARNESS,
    PARTS_ENV,
    PEERS,
    PY,
    cpu,
    descendants,
    remove,
    spawn,
    stop,
    wait_ready,
    workdir,
)

from proxy.bench.ports import free_port
from proxy.bench.stats import quantile

KINDS = ("nginx", "nginx-reuseport", "tokenprobe", "tokenprobe-reuseport")


@dataclass
class Group:
    """One arm: its processes (one supervisor, or N peers) and the port they serve."""

    name: str
    kind: str
    workers: int
    port: int
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)

    def pids(self) -> list[int]:
        return [pid for p in self.procs for pid in descendants(p.pid)]

    def worker_pids(self) -> list[list[int]]:
        """The processes that do the relaying, each with its own children."""
        if self.kind in ("tokenprobe", "nginx", "nginx-reuseport") and len(self.procs) == 1:
            children = [
                pid
                for pid in descendants(self.procs[0].pid)
                if pid != self.procs[0].pid and not _helper_process(pid)
            ]
            if self.kind == "tokenprobe" and self.workers == 1:
                return [[self.procs[0].pid]]
            return [[pid] for pid in children] or [[self.procs[0].pid]]
        return [descendants(p.pid) for p in self.procs]


def _helper_process(pid: int) -> bool:
    """multiprocessing's resource tracker, which uvicorn's supervisor starts beside workers."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"resource_tracker" in f.read()
    except OSError:
        return False


class Load:
    """Emitters and clients, pinned away from the arm."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        available = sorted(os.sched_getaffinity(0))
        n_arm = args.arm_cores or max(1, len(available) // 2)
        if len(available) < 2:
            self.arm_cpus = self.load_cpus = set(available)
        else:
            n_arm = min(n_arm, len(available) - 1)
            self.arm_cpus, self.load_cpus = set(available[:n_arm]), set(available[n_arm:])
        self.work = work
        self.port = free_port()
        self.emitters = [
            spawn(
                [PY, str(PEERS / "emitter.py"), "--port", str(self.port)],
                self.load_cpus,
                log=work / f"emitter{i}.log",
            )
            for i in range(args.emitters)
        ]
        wait_ready(self.emitters[0], self.port, "/v1/chat/completions", 30)
        self.clients = [
            spawn(
                [PY, str(HARNESS / "loadgen.py")],
                self.load_cpus,
                log=work / f"client{i}.log",
                env=PARTS_ENV,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            for i in range(args.clients)
        ]
        for c in self.clients:
            if _read(c, 30).get("event") != "ready":
                raise RuntimeError("load generator did not start")

    def close(self) -> None:
        for c in self.clients:
            if c.stdin is not None:
                try:
                    c.stdin.write(b'{"op": "quit"}\n')
                    c.stdin.flush()
                except OSError:
                    pass
        for p in [*self.clients, *self.emitters]:
            stop(p)


def _read(proc: subprocess.Popen[Any], timeout: float) -> dict[str, Any]:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise TimeoutError(f"load generator silent for {timeout:.0f} s")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError("load generator exited")
    return json.loads(line)  # type: ignore[no-any-return]


def start_arm(kind: str, workers: int, load: Load) -> Group:
    port = free_port()
    group = Group(f"{kind} x{workers}", kind, workers, port)
    work, upstream = load.work, f"http://127.0.0.1:{load.port}"
    log = work / f"{kind}-{workers}.log"
    if kind.startswith("nginx"):
        prefix = work / f"nginx-{kind}-{workers}"
        prefix.mkdir(exist_ok=True)
        conf_text = NGINX_CONF.format(
            user="user root;" if os.geteuid() == 0 else "", prefix=prefix, port=port, sim=load.port
        ).replace("worker_processes 1;", f"worker_processes {workers};")
        if kind == "nginx-reuseport":
            conf_text = conf_text.replace("backlog=4096;", "backlog=4096 reuseport;")
        conf = prefix / "nginx.conf"
        conf.write_text(conf_text)
        cmd = [NGINX, "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "error.log")]
        group.procs.append(spawn(cmd, load.arm_cpus, log=log))
    elif kind == "tokenprobe":
        cmd = [PY, "-m", "proxy", "serve", "--upstream", upstream, "--port", str(port)]
        cmd += ["--access-log", "off", "--workers", str(workers)]
        # --workers N makes its own multiprocess metrics directory; one worker needs none.
        env = (
            {"PROMETHEUS_MULTIPROC_DIR": str(work / f"prom-{kind}-{workers}")}
            if workers > 1
            else {}
        )
        group.procs.append(spawn(cmd, load.arm_cpus, log=log, env=env))
    elif kind == "tokenprobe-reuseport":
        metrics_dir = work / f"prom-{kind}-{workers}"
        metrics_dir.mkdir(exist_ok=True)
        env = {"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)} if workers > 1 else {}
        cmd = [PY, str(PEERS / "reuseport_worker.py"), "--upstream", upstream]
        cmd += ["--port", str(port), "--access-log", "off"]
        group.procs += [spawn(cmd, load.arm_cpus, log=log, env=env) for _ in range(workers)]
    else:
        raise SystemExit(f"unknown arm kind {kind!r}; choose from {', '.join(KINDS)}")
    wait_ready(group.procs[0], port, "/v1/chat/completions", 60)
    time.sleep(0.3 * workers)  # the other workers finish starting
    return group


def per_process_cpu(groups: list[list[int]]) -> list[int]:
    return [cpu(pids)[0] for pids in groups]


def phase(load: Load, arm: Group | None, streams: int, args: argparse.Namespace) -> dict[str, Any]:
    port = load.port if arm is None else arm.port
    workers = [] if arm is None else arm.worker_pids()
    pids = [] if arm is None else arm.pids()
    c0, w0, t0 = cpu(pids)[0], per_process_cpu(workers), time.monotonic_ns()
    n = len(load.clients)
    for i, client in enumerate(load.clients):
        cmd = {
            "op": "stream",
            "port": port,
            "streams": streams // n + (1 if i < streams % n else 0),
            "tokens": args.tokens,
            "step_ms": args.step_ms,
            "duration": args.duration,
            "warm": args.warm,
            "raw": True,
        }
        assert client.stdin is not None
        client.stdin.write((json.dumps(cmd) + "\n").encode())
        client.stdin.flush()
    limit = args.duration + args.tokens * args.step_ms / 1000 * 3 + 60
    results = [_read(c, limit) for c in load.clients]
    wall = time.monotonic_ns() - t0
    c1, w1 = cpu(pids)[0], per_process_cpu(workers)
    latencies = sorted(x for r in results for x in r.get("chunk_latency_ns", []))
    chunks = sum(r.get("chunks", 0) for r in results)
    worker_cores = [(b - a) / wall for a, b in zip(w0, w1, strict=True)]
    return {
        "arm": "direct" if arm is None else arm.name,
        "streams": streams,
        "chunks": chunks,
        "expected_chunks": sum(r.get("expected_chunks", 0) for r in results),
        "errors": sum(r.get("errors", 0) for r in results),
        "delivered_per_s": sum(r.get("delivered_per_s", 0.0) for r in results),
        "offered_per_s": streams / (args.step_ms / 1000),
        "p50_ms": (quantile(latencies, 50) or 0) / 1e6,
        "p99_ms": (quantile(latencies, 99) or 0) / 1e6,
        "arm_cores": (c1 - c0) / wall,
        "cpu_us_per_chunk": (c1 - c0) / 1000 / chunks if chunks and arm is not None else None,
        "worker_cores": worker_cores,
        "worker_pids": workers,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add = p.add_argument
    add("--quick", action="store_true", help="small and short: 64 streams, 1 and 2 workers")
    add("--streams", help="stream counts, comma-separated (default 64,256; quick 64)")
    add("--workers", help="tokenprobe worker counts (default 1,2,4,8; quick 1,2)")
    add("--nginx-workers", help="nginx worker counts (default 1 and the largest of --workers)")
    add("--kinds", default=",".join(KINDS), help=f"arm kinds, from {', '.join(KINDS)}")
    add("--emitters", type=int, default=2)
    add("--clients", type=int, default=2)
    add("--arm-cores", type=int, default=None, help="cores for the arm (default half, >= 1)")
    add("--tokens", type=int, default=None, help="chunks per stream (default 128; quick 40)")
    add("--step-ms", type=float, default=20.0)
    add("--duration", type=float, default=None, help="seconds per phase (default 4; quick 2)")
    add("--rounds", type=int, default=None, help="interleaved rounds (default 2; quick 1)")
    add("--out", type=Path, default=Path("multiproc.json"))
    add("--md", type=Path, default=None)
    add("--render", type=Path, default=None, help="only summarize this results JSON")
    args = p.parse_args(argv)
    q = args.quick
    args.streams = [int(x) for x in (args.streams or ("64" if q else "64,256")).split(",")]
    args.workers = [int(x) for x in (args.workers or ("1,2" if q else "1,2,4,8")).split(",")]
    top = str(max(args.workers))
    both = ",".join(sorted({"1", top}, key=int))
    args.nginx_workers = [int(x) for x in (args.nginx_workers or both).split(",")]
    args.tokens = args.tokens or (40 if q else 128)
    args.duration = args.duration or (2.0 if q else 4.0)
    args.warm = 0.5
    args.rounds = args.rounds or (1 if q else 2)
    return args


def arm_list(args: argparse.Namespace) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for kind in args.kinds.split(","):
        if kind.startswith("nginx"):
            if os.path.exists(NGINX):
                out += [(kind, w) for w in args.nginx_workers]
        else:
            out += [(kind, w) for w in args.workers]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = workdir()
    load = Load(args, work)
    groups: list[Group] = []
    phases: list[dict[str, Any]] = []
    try:
        for kind, w in arm_list(args):
            try:
                groups.append(start_arm(kind, w, load))
            except RuntimeError as exc:
                print(f"  ! {kind} x{w} failed to start: {exc}", file=sys.stderr)
        for r in range(args.rounds):
            for streams in args.streams:
                order = groups[r % max(len(groups), 1) :] + groups[: r % max(len(groups), 1)]
                for arm in [None, *order]:
                    result = phase(load, arm, streams, args)
                    result["round"] = r
                    phases.append(result)
                    print(
                        f"  round {r} {streams:>5} streams {result['arm']:<26} "
                        f"p99 {result['p99_ms']:7.2f} ms  cores {result['arm_cores']:.2f}",
                        file=sys.stderr,
                    )
    finally:
        for g in groups:
            for p in g.procs:
                stop(p)
        load.close()
        remove(work)
    return {
        "machine": {"cores": os.cpu_count(), "arm_cores": sorted(load.arm_cpus)},
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "phases": phases,
    }


def _med(values: list[float]) -> float | None:
    values = sorted(values)
    return quantile(values, 50) if values else None


def markdown(results: dict[str, Any]) -> str:
    cfg, phases = results["config"], results["phases"]
    lines = [
        f"{results['machine']['cores']} cores, arm on {results['machine']['arm_cores']}, "
        f"{cfg['emitters']} emitter and {cfg['clients']} client processes on the others; "
        f"step {cfg['step_ms']:g} ms, {cfg['tokens']} chunks a stream, {cfg['rounds']} "
        "round(s): median over rounds, spread min–max.",
        "",
        "| streams (chunks/s) | arm | delivered | added p50 / p99 per chunk ms | arm cores "
        "| CPU µs/chunk | worker cores, busiest–idlest |",
        "|---|---|---|---|---|---|---|",
    ]
    for streams in cfg["streams"]:
        mine = [p for p in phases if p["streams"] == streams]
        direct = {p["round"]: p for p in mine if p["arm"] == "direct"}
        names = list(dict.fromkeys(p["arm"] for p in mine))
        for name in names:
            ps = [p for p in mine if p["arm"] == name]
            delivered = sum(p["chunks"] for p in ps) / max(sum(p["expected_chunks"] for p in ps), 1)
            if name == "direct":
                p99 = _med([p["p99_ms"] for p in ps])
                added = f"p99 {p99:.2f} (abs.)"
            else:
                a50 = [p["p50_ms"] - direct[p["round"]]["p50_ms"] for p in ps]
                a99 = [p["p99_ms"] - direct[p["round"]]["p99_ms"] for p in ps]
                added = f"{_med(a50) or 0:+.2f} / {_med(a99) or 0:+.2f} ({min(a99):+.1f}–{max(a99):+.1f})"
            cores = _med([p["arm_cores"] for p in ps]) or 0
            per = [p["cpu_us_per_chunk"] for p in ps if p["cpu_us_per_chunk"]]
            cpu_text = f"{_med(per):.1f} ({min(per):.1f}–{max(per):.1f})" if per else "–"
            spread = [sorted(p["worker_cores"], reverse=True) for p in ps if p["worker_cores"]]
            spread_text = (
                ", ".join(f"{s[0]:.2f}–{s[-1]:.2f}" for s in spread) if spread and name else "–"
            )
            rate = f"{streams} ({int(streams / (cfg['step_ms'] / 1000)):,})"
            lines.append(
                f"| {rate} | {name} | {delivered:.1%} | {added} | {cores:.2f} | {cpu_text} "
                f"| {spread_text} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        results = json.loads(args.render.read_text())
    else:
        results = run(args)
        args.out.write_text(json.dumps(results, indent=1))
    text = markdown(results)
    if args.md:
        args.md.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
