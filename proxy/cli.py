"""tokenprobe serve | demo | sim | bench. Each subcommand lives in its own module."""

from __future__ import annotations

import sys
from collections.abc import Callable

USAGE = """usage: tokenprobe COMMAND [options]

commands:
  serve   run the measuring proxy in front of an OpenAI-compatible backend
  demo    run the built-in simulated backend, the proxy and a little traffic
  sim     run the simulated OpenAI-compatible backend (vLLM-shaped)
  bench   measure a backend: TTFT, per-stream speed and aggregate throughput
          (bench compare RUN.json RUN.json ...: compare saved runs;
           bench replay LOG --url URL: replay recorded traffic on a candidate;
           bench merge RUN.json ... --out RUN.json: join the shards of one run)
  dashboard  print the Grafana dashboard with a variable per --label-header label

'tokenprobe COMMAND --help' shows a command's options.
"""


def _command(name: str) -> Callable[[list[str]], int] | None:
    if name == "serve":
        from proxy.server.serve import main as serve

        return serve
    if name == "demo":
        from proxy.demo import main as demo

        return demo
    if name == "sim":
        from proxy.sim.cli import main as sim

        return sim
    if name == "dashboard":
        from proxy.dashboard import main as dashboard

        return dashboard
    if name == "bench":
        from proxy.bench.cli import main as bench

        return bench
    return None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if args else 2
    if args[0] == "--version":
        from proxy import __version__
        from proxy.build import describe

        print(f"tokenprobe {__version__} ({describe()})")
        return 0
    command = _command(args[0])
    if command is None:
        print(f"tokenprobe: unknown command {args[0]!r}\n\n{USAGE}", file=sys.stderr, end="")
        return 2
    return command(args[1:])


if __name__ == "__main__":
    sys.exit(main())
