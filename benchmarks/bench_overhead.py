"""`tokenprobe bench`'s own overhead at 64 concurrent streams: the figures its test only bounds.

The simulator (free-running, TTFT 200 ms, 20 tokens/s, 10 tokens) records when it sent each
first token; the bench, in its own process as it runs for real, records when it saw it.
Both clocks are CLOCK_MONOTONIC. Per request:

- client-seen minus sim-sent: the bench's TTFT minus the simulator's (request received ->
  first token sent): the bench's sending side, the simulator's request parsing, and the
  bench's reading side;
- sent -> timestamped: from the simulator's write of the first token to the bench's
  timestamp of it (the reading side alone);
- TTFT minus the programmed 200 ms: all of the above plus the simulator's timer.

    .venv/bin/python benchmarks/bench_overhead.py            # about 10 s
    .venv/bin/python benchmarks/bench_overhead.py --rounds 3 --requests 384
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import orjson
import uvicorn
from harness import checkout  # noqa: F401  (this checkout's proxy/)

from proxy.sim.app import SimApp, create_sim_app
from proxy.sim.config import SimConfig


def _serve(app: SimApp) -> tuple[uvicorn.Server, int]:
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, port


def _quantiles(values: list[float]) -> str:
    q = statistics.quantiles(values, n=100, method="inclusive")
    return f"p50 {q[49] * 1e3:.3f} / p90 {q[89] * 1e3:.3f} / p99 {q[98] * 1e3:.3f} ms"


def one_round(requests: int, concurrency: int) -> dict[str, list[float]]:
    app = create_sim_app(SimConfig(ttft=0.2, tokens_per_second=20.0, output_tokens=10))
    server, port = _serve(app)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "r.json"
            subprocess.run(
                [sys.executable, "-m", "proxy.bench", "--url", f"http://127.0.0.1:{port}",
                 "--model", "sim-model", "--out", str(out), "--quiet",
                 "--concurrency", str(concurrency), "--requests", str(requests),
                 "--ramp-up", "0.65", "--max-tokens", "10"],
                check=True, capture_output=True, timeout=120,
            )  # fmt: skip
            doc = orjson.loads(out.read_bytes())
    finally:
        server.should_exit = True
    sims = {r.id: r for r in app.state.requests()}
    origin = doc["clock_origin"]
    figures: dict[str, list[float]] = {"over_sent": [], "read_side": [], "ttft_over": []}
    for r in doc["records"]:
        s = sims[r["response_id"]]
        assert s.first_token_at is not None
        figures["over_sent"].append(r["ttft"] - (s.first_token_at - s.started))
        figures["read_side"].append(origin + r["scheduled"] + r["ttft"] - s.first_token_at)
        figures["ttft_over"].append(r["ttft"] - 0.2)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--requests", type=int, default=192)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    for n in range(args.rounds):
        f = one_round(args.requests, args.concurrency)
        print(
            f"round {n + 1}, {args.concurrency} streams, {len(f['over_sent'])} requests:\n"
            f"  client-seen minus sim-sent TTFT  {_quantiles(f['over_sent'])}\n"
            f"  first token sent -> timestamped  {_quantiles(f['read_side'])}\n"
            f"  TTFT minus programmed 200 ms     {_quantiles(f['ttft_over'])}"
        )


if __name__ == "__main__":
    main()
