"""What does tokenprobe cost on the path of a stream? One run measures it against the floor.

The simulator (lockstep: one decode-step clock, every active stream gets one chunk per
step, each chunk its own network read; each text opens with its send time) runs in its own
process; the load generator (raw asyncio + httptools) in another, both pinned away from
the arm under test, which gets a core to itself. Arms, interleaved in rounds:

  direct            client -> simulator (the baseline every "added" figure subtracts)
  relay             a TCP byte relay on uvloop (benchmarks/peers/byte_relay.py): the floor
  nginx             proxy_buffering off, HTTP/1.1 upstream keep-alive (when installed)
  tokenprobe        metrics only (--access-log off), the default data path
  tokenprobe-log    metrics + JSON access log to /dev/null: the arm issue 29's targets quote
  tokenprobe-full   metrics + JSON access log + tracing of every request to a local OTLP sink
  tokenprobe-asgi   as tokenprobe-log, with `--relay asgi` (skipped, with a note, where the
                    tree has no such setting)
  tokenprobe@REF    as tokenprobe-log, from git REF (--ref, via checkout.tree_at)
  tokenprobe-log@source  with --compiled (every other tokenprobe arm then runs the build
                    mypyc compiled, checkout.compiled_tree): tokenprobe-log on the source
  tokenprobe-httpx  metrics only, httpx's own transport (only with --arms)
  tokenprobe-traced metrics + tracing, access log off (only with --arms): tracing's own cost
  litellm           only with --with-litellm (own venv, pass-through endpoint, prometheus)

Load shapes (--shapes, each with its own backend processes; the first one also measures
memory, TTFT and the non-streaming request rates): `apart` (the simulator and the load
generator, two processes), `together` (one process runs both, 128 chunks a stream), and
`emitter` (emitter.py writes each step's chunks in one tight burst). After them, once:
WebSocket echo (ws_echo.py: direct, nginx, tokenprobe; 50 sessions) and a CPU-bound
backend sharing the proxy's core (sidecar.py). The targets table (targets.py) quotes
each shape, the worst first.

Per arm: proxy CPU per relayed chunk and per request (from /proc of the arm's processes
only), added TTFT and added per-chunk latency against direct, delivered/offered
throughput, whether every chunk arrived, the highest chunk rate and request rate held with
added p99 under 5 ms, RSS per 1,000 open streams, and start-to-first-request time.

    .venv/bin/python benchmarks/relay.py --ref 7105b20 --out results.json --md table.md  # ~12 min
    .venv/bin/python benchmarks/relay.py --quick                              # ~2-3 min
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import sidecar
from arms.stack import NGINX_HINT, Arm, Stack, has_relay_setting
from harness.checkout import compiled_tree, tree_at
from harness.procs import (
    PEERS,
    PY,
    ROOT,
    cpu,
    remove,
    rss_bytes,
    system_busy_ns,
    wakeups,
    workdir,
)
from reports.report import chart, markdown, summarize
from reports.targets import issue_targets, targets_markdown

ALL_ARMS = (
    "direct", "relay", "nginx", "tokenprobe", "tokenprobe-log", "tokenprobe-full",
    "tokenprobe-asgi",
)  # fmt: skip
#: Arms run only when named with --arms.
EXTRA_ARMS = ("tokenprobe-httpx", "tokenprobe-traced", "tokenprobe-unmeasured")
#: A path no API measures: tokenprobe relays it on the same wire, without an observer.
UNMEASURED_PATH = "/bench/unmeasured"
SHAPES = ("apart", "together", "emitter")
P99_LIMIT_US = 5000.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--quick", action="store_true", help="a 2-3 min smoke run: fewer, shorter phases")
    add("--shapes", default=",".join(SHAPES), help="load shapes, comma-separated, in order")
    add("--together-tokens", type=int, help="chunks a stream in `together` (default 128)")
    add(
        "--ref",
        action="append",
        default=[],
        help="also run tokenprobe-log's configuration from this git ref (arm tokenprobe@REF)",
    )
    add("--no-extras", action="store_true", help="skip the WebSocket and CPU-bound-backend runs")
    add("--arms", default=",".join(ALL_ARMS), help="comma-separated arms (direct is always run)")
    add("--with-litellm", action="store_true", help="add the LiteLLM arm (installs it once)")
    add("--rounds", type=int, help="rounds of the interleaved sweep (default 3; quick 2)")
    add("--streams", help="concurrency sweep, comma-separated (default 1,16,64,256; quick 1,16)")
    add("--step-ms", type=float, default=20.0, help="lockstep decode step of the sweep")
    add("--tokens", type=int, help="content chunks per streamed request (default 40; quick 10)")
    add("--duration", type=float, help="seconds of load per sweep phase (default 2.5; quick 0.8)")
    add("--rates", help="open-loop non-streaming request rates to try, req/s")
    add("--chunk-rates", help="chunk rates to try in the rate search, chunks/s")
    add("--search-streams", type=int, default=64, help="streams in the chunk-rate search")
    add("--mem-streams", type=int, help="open streams for the memory figure (default 1000)")
    add(
        "--shape",
        choices=("apart", "together"),
        default=None,
        help="one shape only: simulator and load generator as two processes (apart) or in "
        "one event loop (together)",
    )
    add(
        "--backend",
        choices=("sim", "emitter"),
        default=None,
        help="one shape only: tokenprobe's simulator, or the lean emitter.py (each step's "
        "chunks in a tight burst, vLLM-shaped 240-byte chunks)",
    )
    add(
        "--client-us",
        type=float,
        default=0.0,
        help="CPU the load generator burns per content chunk it reads, as a real streaming "
        "client does (with --shape together it also delays the simulator's writes)",
    )
    add("--out", type=Path, default=Path("results.json"))
    add("--png", type=Path, default=None)
    add("--md", type=Path, default=None, help="also write the markdown tables here")
    add(
        "--tree",
        type=Path,
        default=None,
        help="run every tokenprobe arm from this source tree instead of this checkout",
    )
    add(
        "--compiled",
        action="store_true",
        help="run every tokenprobe arm from a copy of this checkout whose per-chunk path "
        "mypyc compiled (setup.py), and add arm tokenprobe-log@source, the pure-Python "
        "source in tokenprobe-log's configuration, beside them",
    )
    add(
        "--compare-tree",
        type=Path,
        action="append",
        default=[],
        help="also run tokenprobe (metrics only) from this source tree, as arm tokenprobe@NAME",
    )
    add(
        "--render",
        type=Path,
        default=None,
        help="run nothing: summarize an existing results JSON again (with --png/--md)",
    )
    add("--keep-logs", action="store_true", help="keep the temp dir with every process's log")
    add(
        "--max-foreign",
        type=float,
        default=0.15,
        help="rerun a phase when other processes on the machine used more than this many cores",
    )
    add(
        "--retry-budget",
        type=float,
        default=None,
        help="seconds the run may spend waiting for a quiet machine and rerunning phases "
        "(default 60; quick 10)",
    )
    args = p.parse_args(argv)
    q = args.quick
    if args.shape or args.backend:  # the one shape these name, as before --shapes
        args.shapes = "emitter" if args.backend == "emitter" else args.shape or "apart"
    args.shapes = [x for x in args.shapes.split(",") if x]
    if bad := [x for x in args.shapes if x not in SHAPES]:
        p.error(f"unknown shape(s) {', '.join(bad)}; choose from {', '.join(SHAPES)}")
    args.shape, args.backend = "apart", "sim"
    args.rounds = args.rounds or 2
    args.streams = [int(x) for x in (args.streams or ("1,64" if q else "1,64,256")).split(",")]
    args.other_streams = [c for c in args.streams if c >= 64] or args.streams
    args.together_tokens = args.together_tokens or (20 if q else 128)
    args.tokens = args.tokens or (10 if q else 40)
    args.duration = args.duration or (0.6 if q else 2.5)
    args.warm = 0.2 if q else 0.5
    args.ttft_duration = 0.4 if q else 1.5
    args.rates = _floats(args.rates, "200" if q else "250,500,1000,2000")
    args.poisson_duration = 0.6 if q else 2.0
    args.chunk_rates = _floats(args.chunk_rates, "")  # e.g. 2000,4000,8000,12000,16000
    args.search_duration = 2.0
    args.mem_streams = args.mem_streams or (100 if q else 1000)
    args.hold = 1.5 if q else 3.0
    args.start_repeats = 1 if q else 3
    if args.retry_budget is None:
        args.retry_budget = 10.0 if q else 60.0
    return args


def _floats(given: str | None, default: str) -> list[float]:
    """A comma-separated list; an empty string given on the command line means none."""
    return [float(x) for x in (default if given is None else given).split(",") if x]


class Bench:
    def __init__(self, args: argparse.Namespace, stack: Stack) -> None:
        self.args = args
        self.stack = stack
        self.phases: list[dict[str, Any]] = []
        self.retry_left = args.retry_budget

    def phase(self, arm: Arm, cmd: dict[str, Any], timeout: float, **tags: Any) -> dict[str, Any]:
        """Run one load-generator command through `arm`, with the arm's CPU time around it.

        The machine may be shared: when other processes took more than --max-foreign cores
        during the phase, wait for a quiet moment and run it again (within --retry-budget).
        """
        retries = 0
        while True:
            result = self._phase_once(arm, cmd, timeout)
            if result["foreign_cpu_cores"] <= self.args.max_foreign or self.retry_left <= 0:
                break
            t0 = time.monotonic()
            self.wait_quiet()
            self.retry_left -= time.monotonic() - t0 + result["phase_wall_s"]
            retries += 1
        result.update(tags, retries=retries)
        if "error" in result:
            print(f"  ! {arm.name} {cmd['op']}: {result['error']}", file=sys.stderr)
        self.phases.append(result)
        return result

    def wait_quiet(self, limit: float = 20.0) -> None:
        """Until other processes use less than half of --max-foreign cores for 0.5 s."""
        deadline = time.monotonic() + min(limit, max(self.retry_left, 0))
        while time.monotonic() < deadline:
            b0 = system_busy_ns()
            time.sleep(0.5)
            if (system_busy_ns() - b0) / 0.5e9 < self.args.max_foreign / 2:
                return

    def _phase_once(self, arm: Arm, cmd: dict[str, Any], timeout: float) -> dict[str, Any]:
        pids, gen = arm.pids(), self.stack.generator_pids()
        ours = [*pids, *gen, *self.stack.peer_pids(), os.getpid()]
        w0 = wakeups(pids)
        c0, g0, o0, b0, t0 = cpu(pids), cpu(gen), cpu(ours), system_busy_ns(), time.monotonic_ns()
        self.stack.tell_gen({**cmd, "port": arm.port, "path": arm.path, "headers": arm.headers})
        result = self.stack.read_gen(timeout)
        c1, g1, o1, b1 = cpu(pids), cpu(gen), cpu(ours), system_busy_ns()
        w1 = wakeups(pids)
        wall = time.monotonic_ns() - t0
        result.update(
            arm=arm.name,
            op=cmd["op"],
            proxy_cpu_ns=c1[0] - c0[0],
            proxy_cpu_stat_ns=c1[1] - c0[1],
            proxy_cpu_util=(c1[0] - c0[0]) / wall,
            proxy_wakeups=w1 - w0,
            generator_cpu_util=(g1[0] - g0[0]) / wall,
            foreign_cpu_cores=max(0, (b1 - b0) - (o1[1] - o0[1])) / wall,
            phase_wall_s=wall / 1e9,
        )
        return result

    def stream(
        self,
        arm: Arm,
        streams: int,
        step_ms: float | None,
        duration: float,
        tokens: int,
        **tags: Any,
    ) -> dict[str, Any]:
        cmd = {
            "op": "stream",
            "streams": streams,
            "tokens": tokens,
            "step_ms": step_ms,
            "duration": duration,
            "warm": self.args.warm,
            "client_us": self.args.client_us,
        }
        if step_ms is None:  # free-running: as fast as the simulator goes, first token at once
            cmd.update(ttft=0.0, tps=2000.0)
        timeout = duration + tokens * (step_ms or 1) / 1000 * 3 + 60
        return self.phase(arm, cmd, timeout, streams=streams, step_ms=step_ms, **tags)

    def poisson(self, arm: Arm, rate: float, **tags: Any) -> dict[str, Any]:
        d = self.args.poisson_duration
        cmd = {"op": "poisson", "rate": rate, "duration": d, "tokens": 1}
        return self.phase(arm, cmd, d + 60, rate=rate, **tags)

    def memory(self, arm: Arm) -> dict[str, Any]:
        """RSS of the arm's processes with N streams open, against just before."""
        n, hold = self.args.mem_streams, self.args.hold
        base = rss_bytes(arm.pids())
        self.stack.tell_gen(
            {
                "op": "hold",
                "streams": n,
                "hold": hold,
                "port": arm.port,
                "path": arm.path,
                "headers": arm.headers,
            }
        )
        opened = self.stack.read_gen(hold + 60)
        peak = 0
        for _ in range(5):
            peak = max(peak, rss_bytes(arm.pids()))
            time.sleep(0.05)
        result = self.stack.read_gen(hold + 60)
        result.update(
            arm=arm.name,
            op="hold",
            open=opened.get("streams"),
            rss_base=base,
            rss_peak=peak,
            rss_mib_per_1000=(peak - base) / 2**20 * 1000 / n,
        )
        self.phases.append(result)
        return result


def unmeasured(arm: Arm) -> Arm:
    """`arm`'s load sent to UNMEASURED_PATH: the same data path, nothing measured."""
    arm.path = UNMEASURED_PATH
    arm.notes.append(f"requests to {UNMEASURED_PATH}: relayed, not measured")
    return arm


def make_arms(args: argparse.Namespace, stack: Stack, notes: list[str]) -> list[Arm]:
    wanted = ["direct"] + [a for a in args.arms.split(",") if a and a != "direct"]
    arms: list[Arm] = []
    for name in wanted:
        arm: Arm | None
        if name == "direct":
            arm = stack.direct()
        elif name == "relay":
            arm = stack.byte_relay()
        elif name == "nginx":
            arm = stack.nginx()
            if arm is None:
                notes.append(NGINX_HINT)
                print(NGINX_HINT, file=sys.stderr)
        elif name == "tokenprobe-traced":  # tracing on, access log off: tracing's own cost
            tree = args.tree.resolve() if args.tree else ROOT
            arm = stack.tokenprobe(name, "aiohttp", full=False, tree=tree, traced=True)
        elif name in ("tokenprobe", "tokenprobe-full", "tokenprobe-httpx"):
            transport = "httpx" if name == "tokenprobe-httpx" else "aiohttp"
            tree = args.tree.resolve() if args.tree else ROOT
            arm = stack.tokenprobe(name, transport, full=name == "tokenprobe-full", tree=tree)
        elif name == "tokenprobe-log":  # metrics + JSON access log: the targets' arm
            tree = args.tree.resolve() if args.tree else ROOT
            arm = stack.tokenprobe(name, "aiohttp", full=False, access_log=True, tree=tree)
        elif name == "tokenprobe-unmeasured":  # tokenprobe-log's data path, nothing measured
            if args.backend != "emitter":  # the simulator answers only the APIs' paths
                arm = None
                notes.append("tokenprobe-unmeasured: emitter shape only (the sim 404s it)")
            else:
                tree = args.tree.resolve() if args.tree else ROOT
                arm = unmeasured(
                    stack.tokenprobe(name, "aiohttp", full=False, access_log=True, tree=tree)
                )
        elif name == "tokenprobe-asgi":
            tree = args.tree.resolve() if args.tree else ROOT
            arm = None
            if has_relay_setting(tree):
                arm = stack.tokenprobe(
                    name, "aiohttp", full=False, access_log=True, tree=tree, relay="asgi"
                )
            else:
                notes.append("tokenprobe-asgi: this tree has no --relay setting; arm skipped")
                print(notes[-1], file=sys.stderr)
        else:
            known = ", ".join((*ALL_ARMS, *EXTRA_ARMS))
            raise SystemExit(f"unknown arm {name!r}; choose from {known}")
        if arm is not None:
            arms.append(arm)
    for tree in args.compare_tree:
        arms.append(
            stack.tokenprobe(f"tokenprobe@{tree.name}", "aiohttp", full=False, tree=tree.resolve())
        )
    if args.compiled:
        arms.append(
            stack.tokenprobe(
                "tokenprobe-log@source",
                "aiohttp",
                full=False,
                access_log=True,
                tree=args.source_tree.resolve(),
            )
        )
    for ref, tree in zip(args.ref, args.ref_trees, strict=True):  # as tokenprobe-log
        arms.append(
            stack.tokenprobe(f"tokenprobe@{ref}", "aiohttp", full=False, access_log=True, tree=tree)
        )
    if args.with_litellm:
        arms.append(stack.litellm())
    return arms


def machine() -> dict[str, Any]:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu_model": model,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every shape in turn (the first one in full), then the once-only extras; the first
    shape's results are the top level, as a one-shape run writes them."""
    t_begin = time.monotonic()
    work = workdir()
    try:
        args.ref_trees = [tree_at(ref, work) for ref in args.ref]
        if args.compiled:  # the source stays beside it, as arm tokenprobe-log@source
            args.source_tree, args.tree = args.tree or ROOT, compiled_tree(work)
        runs: dict[str, dict[str, Any]] = {}
        for i, shape in enumerate(args.shapes):
            shape_args = argparse.Namespace(**vars(args))
            shape_args.shape = "together" if shape == "together" else "apart"
            shape_args.backend = "emitter" if shape == "emitter" else "sim"
            shape_args.primary = i == 0
            shape_args.retry_budget = args.retry_budget / len(args.shapes)  # one budget in all
            if shape == "together":
                shape_args.tokens = args.together_tokens
            if i:
                shape_args.streams = args.other_streams
            log(t_begin, f"shape {shape} ({i + 1}/{len(args.shapes)})")
            runs[shape] = run_shape(shape_args, t_begin)
        extras: dict[str, Any] = {}
        if not args.no_extras:
            extras["websocket"] = websocket_arms(args, work, t_begin)
            try:
                tree = args.tree.resolve() if args.tree else ROOT
                extras["sidecar"] = sidecar.run(work, quick=args.quick, tree=tree)
            except Exception as exc:  # reported in the table, never a crash at the end
                extras["sidecar"] = {"error": f"{type(exc).__name__}: {exc}"}
            log(t_begin, "extras done")
    finally:
        if not args.keep_logs:
            remove(work)
        else:
            print(f"logs kept in {work}", file=sys.stderr)
    results = runs[args.shapes[0]]
    results["shapes"] = {name: r for name, r in runs.items() if r is not results}
    results["extras"] = extras
    results["elapsed_s"] = time.monotonic() - t_begin
    compose(results)
    return results


def compose(results: dict[str, Any]) -> None:
    """Summaries, the targets table and the markdown, from the phases (also for --render)."""
    results["summary"] = summarize(results, P99_LIMIT_US)
    shapes = {results["config"].get("shape_name", "apart"): results["summary"]}
    for name, r in results.get("shapes", {}).items():
        r["summary"] = summarize(r, P99_LIMIT_US)
        shapes[name] = r["summary"]
    high = max(results["config"]["streams"])
    targets = issue_targets(shapes, results.get("extras", {}), high)
    results["issue_targets"] = targets
    by_name = {next(iter(shapes)): results, **results.get("shapes", {})}
    built = "compiled by mypyc" if results["config"].get("compiled") else "the pure-Python source"
    parts = [f"tokenprobe's arms run {built} (tokenprobe --version says which).", ""]
    parts += [targets_markdown(targets)]
    for name in targets["order"]:  # the worst shape first
        parts += [f"### Shape {name}", "", markdown(by_name[name])]
    results["markdown"] = "\n".join(parts)


def run_shape(args: argparse.Namespace, t_begin: float) -> dict[str, Any]:
    """One load shape: its own backend, load generator and arms."""
    work = workdir()
    stack = Stack(work)
    notes: list[str] = []
    bench = Bench(args, stack)
    primary = args.primary
    args.shape_name = "emitter" if args.backend == "emitter" else args.shape
    try:
        stack.start_backend(args.shape, args.backend)
        arms = make_arms(args, stack, notes)
        stack.arms = arms
        for arm in list(arms):  # start-to-first-request, on fresh processes; the last one stays up
            try:
                repeats = args.start_repeats if primary else 1
                for i in range(repeats):
                    arm.launch()
                    if i < repeats - 1:
                        arm.stop()
            except (RuntimeError, OSError, Exception) as exc:
                notes.append(f"{arm.name}: failed to start: {exc}")
                print(f"  ! {arm.name} failed to start: {exc}", file=sys.stderr)
                arm.stop()
                arms.remove(arm)
        log(
            t_begin,
            "started: "
            + ", ".join(f"{a.name} {statistics.median(a.start_s):.2f}s" for a in arms if a.start_s),
        )

        for arm in arms:  # warm every code path once
            bench.stream(arm, 16, args.step_ms, 0.3, 5, kind="warmup")
            bench.poisson(arm, 100, kind="warmup")
        if primary:
            for arm in arms:
                if arm.name != "direct":
                    bench.memory(arm)
            log(t_begin, "memory done")

        for r in range(args.rounds):
            order = arms[r % len(arms) :] + arms[: r % len(arms)]
            for arm in order:
                for streams in args.streams:
                    bench.stream(
                        arm,
                        streams,
                        args.step_ms,
                        args.duration,
                        args.tokens,
                        kind="sweep",
                        round=r,
                    )
                if primary:
                    bench.stream(arm, 1, None, args.ttft_duration, 4, kind="ttft", round=r)
            log(t_begin, f"round {r + 1}/{args.rounds} done")

        if args.rates and primary:
            search(bench, arms, "poisson", args.rates)
            log(t_begin, "request-rate search done")
        if args.chunk_rates and primary:
            search(bench, arms, "chunks", args.chunk_rates)
            log(t_begin, "chunk-rate search done")
        tracing_exports = stack.otlp_exports()
    finally:
        stack.close()
        if not args.keep_logs:
            remove(work)
        else:
            print(f"logs kept in {work}", file=sys.stderr)

    results: dict[str, Any] = {
        "machine": machine(),
        "config": {k: _plain(v) for k, v in vars(args).items()},
        "cores": {
            "proxy": sorted(stack.proxy_cpus),
            "simulator": sorted(stack.sim_cpus),
            "load_generator": sorted(stack.gen_cpus),
        },
        "notes": notes,
        "arm_notes": {a.name: a.notes for a in arms},
        "start_s": {a.name: a.start_s for a in arms},
        "otlp_export_requests": tracing_exports,
        "phases": bench.phases,
        "elapsed_s": time.monotonic() - t_begin,
    }
    return results


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def websocket_arms(args: argparse.Namespace, work: Path, t_begin: float) -> dict[str, Any]:
    """WebSocket echo through direct, nginx and tokenprobe-log: arm CPU per message echoed
    (one message each way), 50 sessions of small text messages, interleaved rounds."""
    stack = Stack(work)
    out: dict[str, Any] = {}
    try:
        stack.ws_backend()
        stack.sim_port = stack.ws_port  # every HTTP request (readiness probes) goes there too
        arms: list[Arm] = [Arm("direct", stack.ws_port)]
        if (nginx := stack.nginx()) is not None:
            arms.append(nginx)
        tree = args.tree.resolve() if args.tree else ROOT
        arms.append(
            stack.tokenprobe(
                "tokenprobe", "aiohttp", full=False, access_log=True, tree=tree,
                upstream=f"http://127.0.0.1:{stack.ws_port}",
            )
        )  # fmt: skip
        from harness.procs import wait_ready

        assert stack.ws is not None
        wait_ready(stack.ws, stack.ws_port, "/v1/chat/completions", 30)
        for arm in list(arms):
            try:
                arm.launch()
            except Exception as exc:
                out[arm.name] = {"error": f"failed to start: {exc}"}
                arms.remove(arm)
        duration = 1.0 if args.quick else 3.0
        runs: dict[str, list[dict[str, Any]]] = {a.name: [] for a in arms}
        for r in range(args.rounds):
            for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
                runs[arm.name].append(ws_phase(stack, arm, duration))
        for name, phases in runs.items():
            per = [p["cpu_us_per_message"] for p in phases if p.get("cpu_us_per_message")]
            out[name] = {
                "phases": phases,
                "cpu_us_per_message": statistics.median(per) if per else None,
                "messages_per_s": statistics.median(p["messages"] / p["wall_s"] for p in phases),
            }
            errors = [p for p in phases if p["errors"]]
            if errors:
                out[name]["error"] = (
                    f"{errors[0]['errors']} sessions failed: {errors[0]['reasons']}"
                )
    finally:
        stack.close()
    log(t_begin, "websocket arms done")
    return out


def ws_phase(stack: Stack, arm: Arm, duration: float) -> dict[str, Any]:
    import subprocess

    pids = arm.pids()
    c0 = cpu(pids)
    cmd = [PY, str(PEERS / "ws_echo.py"), "client", "--port", str(arm.port),
           "--path", "/ws", "--sessions", "50", "--duration", str(duration)]  # fmt: skip
    gen = stack.gen_cpus
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=duration + 60,
        preexec_fn=lambda: os.sched_setaffinity(0, gen),
    )  # fmt: skip
    c1 = cpu(pids)
    try:
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"messages": 0, "errors": 50, "wall_s": duration, "reasons": {done.stderr[-300:]: 1}}
    if arm.name != "direct" and result["messages"]:
        result["cpu_us_per_message"] = (c1[0] - c0[0]) / 1000 / result["messages"]
    return result


def search(bench: Bench, arms: list[Arm], kind: str, rates: list[float]) -> None:
    """Raise the rate until an arm's added p99 passes 5 ms (or it drops or loses anything).

    Every rate runs direct first, as the baseline of that rate; an arm that fails leaves the
    search. When direct itself fails, the load generator or simulator is the limit and the
    search stops there (the summary says so).
    """
    args = bench.args
    alive = list(arms)
    for rate in rates:
        for arm in alive:
            if kind == "poisson":
                bench.poisson(arm, rate, kind="rps-search")
            else:
                step = args.search_streams / rate * 1000
                bench.stream(
                    arm,
                    args.search_streams,
                    step,
                    args.search_duration,
                    args.tokens,
                    kind="chunk-search",
                    rate=rate,
                )
        tag = "rps-search" if kind == "poisson" else "chunk-search"
        got = {p["arm"]: p for p in bench.phases if p.get("kind") == tag and p.get("rate") == rate}
        from reports.report import passes

        verdicts = {
            name: passes(kind, p, got.get("direct"), P99_LIMIT_US) for name, p in got.items()
        }
        for p in got.values():
            p["pass"] = verdicts[p["arm"]]
        if not verdicts.get("direct", False):
            return
        alive = [a for a in alive if verdicts.get(a.name, False)]
        if len(alive) <= 1:
            return


def log(t0: float, message: str) -> None:
    print(f"[{time.monotonic() - t0:6.1f}s] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render is not None:
        results = json.loads(args.render.read_text())
        compose(results)
        args.out = args.render
    else:
        results = run(args)
    args.out.write_text(json.dumps(results, indent=1, default=str))
    if args.png is not None:
        chart(results, args.png)
    if args.md is not None:
        args.md.write_text(results["markdown"])
    print(results["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
