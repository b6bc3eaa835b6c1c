"""One tokenprobe worker on its own SO_REUSEPORT socket: the other way to run N workers.

`tokenprobe serve --workers N` (uvicorn's supervisor) binds one listening socket and its
N processes all accept from it, so the process whose epoll wakes first takes the
connection. Started N times, this binds N sockets to one port with SO_REUSEPORT, and the
kernel hashes each new connection to one of them. The multi-process benchmark runs both.
Arguments are `tokenprobe serve`'s; set PROMETHEUS_MULTIPROC_DIR for shared metrics. Like
every peer it imports `proxy` from its PYTHONPATH (multiproc.py puts this checkout there).

    python benchmarks/peers/reuseport_worker.py --upstream http://127.0.0.1:9000 --port 9001
"""

from __future__ import annotations

import os
import socket
import sys

import uvicorn

from proxy.server.serve import build_app, uvicorn_options
from proxy.settings import parse


def main() -> None:
    settings = parse(sys.argv[1:], os.environ)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((settings.host, settings.port))
    config = uvicorn.Config(build_app(settings), **uvicorn_options(settings), backlog=4096)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
