"""A/B a change to the proxy: tokenprobe from two source trees, interleaved, CPU only.

    cp -r proxy /tmp/before/            # before editing
    ... edit proxy/ ...
    .venv/bin/python benchmarks/ab.py /tmp/before . --rounds 8

Each round runs both trees, in alternating order, under the same streaming load (CPU µs
per relayed chunk) and the same open-loop non-streaming load (CPU µs per request), and
prints the median of each and of the per-round ratio B/A with its min-max.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from arms.stack import Stack
from harness.procs import remove, workdir
from relay import Bench, parse_args


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--duration", type=float, default=3.0)
    p.add_argument("--rate", type=float, default=400.0, help="non-streaming req/s (0: skip)")
    p.add_argument("--transport", default="aiohttp", choices=["aiohttp", "httpx"])
    p.add_argument("--full", action="store_true", help="access log and tracing on")
    p.add_argument("--log-level", default=None, help="the proxies' --log-level (default: theirs)")
    args = p.parse_args()

    work = workdir()
    stack = Stack(work)
    bench = Bench(parse_args(["--retry-budget", "300"]), stack)
    bench.args.poisson_duration = args.duration
    try:
        stack.start_backend()
        arms = [
            stack.tokenprobe(
                name, args.transport, args.full, tree=tree.resolve(), log_level=args.log_level
            )
            for name, tree in (("A", args.a), ("B", args.b))
        ]
        stack.arms = arms
        for arm in arms:
            arm.launch()
            bench.stream(arm, 16, args.step_ms, 0.5, 5, kind="warmup")
        chunk: dict[str, list[float]] = {"A": [], "B": []}
        request: dict[str, list[float]] = {"A": [], "B": []}
        for r in range(args.rounds):
            for arm in arms if r % 2 == 0 else arms[::-1]:
                s = bench.stream(
                    arm, args.streams, args.step_ms, args.duration, args.tokens, kind="ab"
                )
                chunk[arm.name].append(s["proxy_cpu_ns"] / 1000 / max(1, s["chunks"]))
                if args.rate:
                    q = bench.poisson(arm, args.rate, kind="ab")
                    request[arm.name].append(q["proxy_cpu_ns"] / 1000 / max(1, q["requests"]))
            print(
                f"round {r + 1}: chunk A {chunk['A'][-1]:.1f} B {chunk['B'][-1]:.1f}"
                + (
                    f"  request A {request['A'][-1]:.0f} B {request['B'][-1]:.0f}"
                    if args.rate
                    else ""
                ),
                file=sys.stderr,
            )
    finally:
        stack.close()
        remove(work)
    for label, data in (("CPU µs per chunk", chunk), ("CPU µs per request", request)):
        if not data["A"]:
            continue
        ratios = [b / a for a, b in zip(data["A"], data["B"], strict=True)]
        print(
            f"{label}: median A {statistics.median(data['A']):.1f} B {statistics.median(data['B']):.1f}, "
            f"min A {min(data['A']):.1f} B {min(data['B']):.1f}; "
            f"B/A per round {statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
