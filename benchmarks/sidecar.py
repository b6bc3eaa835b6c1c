"""A CPU-bound backend sharing the proxy's core: how much of its throughput the proxy takes.

The simulator burns `--cpu-per-token-us` of CPU per generated token (as a backend's
decode would), pinned to the same core as the proxy; `tokenprobe bench` (concurrency 8,
64 tokens a request) runs on the other core, direct, through the byte relay (also on the
proxy's core) and through tokenprobe, alternated. The figure is output tokens/s through
tokenprobe over the better of the two baselines, the median of the rounds: on the 2-core
development machine the simulator streamed 3-4x slower to a client on the other core
directly than through any hop on its own core (TPOT 1.3 against 0.33 ms at concurrency 1,
with the byte relay as with tokenprobe), so direct alone would flatter the proxy.

    .venv/bin/python benchmarks/sidecar.py                 # about 1 min
    .venv/bin/python benchmarks/sidecar.py --quick         # about 20 s
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness.procs import PEERS, PY, ROOT, cores, spawn, stop, wait_ready

from proxy.bench.ports import free_port


def bench(url: str, requests: int, gen_cpus: set[int], out: Path) -> dict[str, Any]:
    cmd = [PY, "-m", "proxy.bench", "--url", url, "--model", "sim-model", "--quiet",
           "--concurrency", "8", "--requests", str(requests), "--max-tokens", "64",
           "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=300,
                   preexec_fn=lambda: __import__("os").sched_setaffinity(0, gen_cpus))  # fmt: skip
    doc = json.loads(out.read_text())
    level = doc["summary"][0]
    return {"output_tok_s": level["output_throughput"], "ttft_p50": level["ttft"]["p50"]}


def run(
    work: Path,
    *,
    quick: bool,
    cpu_per_token_us: float = 300.0,
    proxy_args: list[str] | None = None,
    tree: Path = ROOT,
) -> dict[str, Any]:
    """Direct and through `tokenprobe serve` (metrics + JSON access log unless
    `proxy_args` say otherwise), alternated; both sharing one core with the simulator."""
    proxy_cpus, _, gen_cpus = cores()
    sim_port, proxy_port, relay_port = free_port(), free_port(), free_port()
    sim = spawn(
        [PY, "-m", "proxy.sim", "--port", str(sim_port), "--ttft", "0",
         "--cpu-per-token-us", str(cpu_per_token_us), "--output-tokens", "64", "--tps", "100000"],
        proxy_cpus, log=work / "sidecar-sim.log",
    )  # fmt: skip
    args = proxy_args if proxy_args is not None else ["--access-log", "json"]
    proxy = spawn(
        [PY, "-m", "proxy", "serve", "--upstream", f"http://127.0.0.1:{sim_port}",
         "--port", str(proxy_port), *args],
        proxy_cpus, log=work / "sidecar-proxy.log", stdout=subprocess.DEVNULL, tree=tree,
    )  # fmt: skip
    relay = spawn(
        [PY, str(PEERS / "byte_relay.py"), "--port", str(relay_port), "--upstream-port", str(sim_port)],
        proxy_cpus, log=work / "sidecar-relay.log",
    )  # fmt: skip
    rounds, requests = (1, 24) if quick else (2, 80)
    figures: dict[str, list[dict[str, Any]]] = {"direct": [], "relay": [], "tokenprobe": []}
    try:
        wait_ready(sim, sim_port, "/v1/chat/completions", 30)
        wait_ready(proxy, proxy_port, "/v1/chat/completions", 30)
        wait_ready(relay, relay_port, "/v1/chat/completions", 30)
        arms = [("direct", sim_port), ("relay", relay_port), ("tokenprobe", proxy_port)]
        for name, port in arms:  # warm-up: imports, connections, the first allocations
            bench(f"http://127.0.0.1:{port}/v1", 8, gen_cpus, work / f"sidecar-warm-{name}.json")
        for r in range(rounds):
            for name, port in arms if r % 2 == 0 else arms[::-1]:
                out = work / f"sidecar-{name}-{r}.json"
                figures[name].append(bench(f"http://127.0.0.1:{port}/v1", requests, gen_cpus, out))
    finally:
        stop(relay)
        stop(proxy)
        stop(sim)
    direct = [f["output_tok_s"] for f in figures["direct"]]
    relayed = [f["output_tok_s"] for f in figures["relay"]]
    best = [max(d, r) for d, r in zip(direct, relayed, strict=True)]
    proxied = [f["output_tok_s"] for f in figures["tokenprobe"]]
    return {
        "cpu_per_token_us": cpu_per_token_us,
        "rounds": figures,
        "ratio": statistics.median(p / b for p, b in zip(proxied, best, strict=True)),
        "direct_tok_s": statistics.median(best),  # the better baseline, round by round
        "plain_direct_tok_s": statistics.median(direct),
        "relay_tok_s": statistics.median(relayed),
        "proxied_tok_s": statistics.median(proxied),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cpu-per-token-us", type=float, default=300.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = run(Path(tmp), quick=args.quick, cpu_per_token_us=args.cpu_per_token_us)
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
