"""Profile one arm under a steady streaming load with py-spy; print where its time goes.

    .venv/bin/pip install py-spy
    .venv/bin/python benchmarks/profile_proxy.py --arm tokenprobe --streams 64 --seconds 20
    # where a chunk's time goes on the wire, in the worst load shape (about 40 s):
    .venv/bin/python benchmarks/profile_proxy.py --arm tokenprobe-log --backend emitter \
        --streams 64 --tokens 128 --seconds 10 --raw profile-wire.folded

Writes the collapsed stacks (`--raw`, flamegraph.pl / speedscope input) and prints the
functions with the most samples, by own time and including callees. py-spy samples from
outside the process (`--nonblocking`), on the load generator's core.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import sys
import threading
import time
from pathlib import Path

from arms.stack import Stack
from harness.procs import remove, spawn, workdir
from relay import ALL_ARMS, EXTRA_ARMS, unmeasured


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--arm",
        default="tokenprobe",
        choices=[
            a for a in (*ALL_ARMS, *EXTRA_ARMS) if a.startswith("tokenprobe-") or a == "tokenprobe"
        ],
    )
    p.add_argument("--streams", type=int, default=64)
    p.add_argument(
        "--poisson",
        type=float,
        default=None,
        help="instead of streams: open-loop non-streaming requests at this rate (req/s)",
    )
    p.add_argument("--backend", choices=("sim", "emitter"), default="sim")
    p.add_argument("--shape", choices=("apart", "together"), default="apart")
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--rate", type=int, default=500, help="py-spy samples per second")
    p.add_argument("--raw", type=Path, default=Path("profile.folded"))
    p.add_argument("--top", type=int, default=35)
    p.add_argument("--native", action="store_true", help="py-spy --native: C frames too")
    p.add_argument(
        "--tree",
        type=Path,
        default=None,
        help="run the arm from this source tree (a compiled one: benchmarks/harness/checkout.py's "
        "compiled_tree; profile it with --native, mypyc's functions are C frames)",
    )
    args = p.parse_args()
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(pyspy).exists():
        raise SystemExit("py-spy not found: .venv/bin/pip install py-spy")

    work = workdir()
    stack = Stack(work)
    try:
        stack.start_backend(args.shape, args.backend)
        transport = "httpx" if args.arm == "tokenprobe-httpx" else "aiohttp"
        arm = stack.tokenprobe(
            args.arm,
            transport,
            full=args.arm == "tokenprobe-full",
            access_log=args.arm
            in ("tokenprobe-log", "tokenprobe-full", "tokenprobe-asgi", "tokenprobe-unmeasured"),
            relay="asgi" if args.arm == "tokenprobe-asgi" else None,
            **({"tree": args.tree.resolve()} if args.tree else {}),
        )
        if args.arm == "tokenprobe-unmeasured":  # as relay.py's arm
            arm = unmeasured(arm)
        stack.arms = [arm]
        arm.launch()
        assert arm.proc is not None
        cmd = {
            "op": "stream",
            "port": arm.port,
            "path": arm.path,
            "streams": args.streams,
            "tokens": args.tokens,
            "step_ms": args.step_ms,
            "duration": args.seconds + 2,
        }
        if args.poisson:
            cmd = {
                "op": "poisson",
                "port": arm.port,
                "path": arm.path,
                "rate": args.poisson,
                "duration": args.seconds + 2,
                "tokens": 1,
            }
        stack.tell_gen({**cmd, "duration": 2})  # warm up
        stack.read_gen(60)
        stack.tell_gen(cmd)
        time.sleep(1)
        spy = spawn(
            [
                pyspy,
                "record",
                # py-spy reads native stacks only from a paused process
                *([] if args.native else ["--nonblocking"]),
                "--format",
                "raw",
                "--rate",
                str(args.rate),
                "--duration",
                str(int(args.seconds)),
                "--pid",
                str(arm.proc.pid),
                "-o",
                str(args.raw),
                *(["--native"] if args.native else []),
            ],
            stack.gen_cpus,
            log=work / "py-spy.log",
        )
        result: dict[str, object] = {}
        reader = threading.Thread(target=lambda: result.update(stack.read_gen(args.seconds + 120)))
        reader.start()
        spy.wait(args.seconds + 60)
        reader.join(args.seconds + 120)
        print(f"load: {result}", file=sys.stderr)
    finally:
        stack.close()
        remove(work)
    report(args.raw, args.top)
    return 0


def report(raw: Path, top: int) -> None:
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        frames = [_short(f) for f in stack.split(";") if f]
        samples += n
        if frames:
            own[frames[-1]] += n
        for frame in set(frames):
            total[frame] += n
    print(f"{samples} samples\n\nown time:")
    for frame, n in own.most_common(top):
        print(f"{100 * n / samples:5.1f}%  {frame}")
    print("\nincluding callees:")
    for frame, n in total.most_common(top):
        print(f"{100 * n / samples:5.1f}%  {frame}")


def _short(frame: str) -> str:
    # "func (path/to/module.py:123)" -> "func (module.py)"
    name, _, where = frame.partition(" (")
    file = where.split(":")[0].rsplit("/", 1)[-1]
    return f"{name} ({file})"


if __name__ == "__main__":
    sys.exit(main())
