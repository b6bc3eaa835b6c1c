"""`tokenprobe serve`: settings -> app -> uvicorn (uvloop and httptools when installed),
relaying on the wire (proxy/server/wire/, uvicorn's protocol) or, with `--relay asgi`,
through the ASGI relay.

With `--workers N` uvicorn runs N processes sharing the port, each handed the settings
the parent resolved, whole (`WorkerApp`). Their metrics go through prometheus-client's
multiprocess mode: every process writes its values to files in one directory (a previous
run's files removed at start), and whichever process answers a scrape sums them all.
Live gauges of processes that died are dropped at each scrape.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import logging
import os
import secrets
import shutil
import signal
import socket
import stat
import sys
import tempfile
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors import Multiprocess

from proxy.openfiles import raise_open_file_limit
from proxy.server.app import ProxyApp
from proxy.server.assemble import assemble, check_environment
from proxy.server.certwatch import listener_context
from proxy.server.eventloop import loop_factory
from proxy.server.multiproc import MULTIPROC_ENV, fresh_metrics_directory
from proxy.settings import Settings, SettingsError, parse


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    return {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level,
        "access_log": False,  # tokenprobe writes its own access log
        "timeout_graceful_shutdown": settings.drain_timeout,
        "timeout_keep_alive": settings.keep_alive_timeout,
        "server_header": False,  # the upstream's headers pass through; add none of ours
        "date_header": False,
        # The client is the connection's peer: uvicorn's default would take it from a
        # loopback client's own X-Forwarded-For, which the proxy passes on with the peer
        # added (proxy/server/headers.py `forwarded_for`), as the wire does.
        "proxy_headers": False,
        # uvloop (or asyncio's), with the TLS handshake bounded by --header-timeout
        "loop": loop_factory(settings.header_timeout),
        # httptools with limits on the request head while it arrives (proxy.server.protocol);
        # the wire is that protocol relaying itself (proxy.server.wire).
        "http": PROTOCOLS[settings.relay],
        # HTTPS and WSS when asked, mutual TLS too, as vLLM's flags of the same names (the
        # files were checked with the settings).
        "ssl_certfile": settings.ssl_certfile,
        "ssl_keyfile": settings.ssl_keyfile,
        "ssl_ca_certs": settings.ssl_ca_certs,
        "ssl_cert_reqs": settings.ssl_cert_reqs,
        **({"ssl_ciphers": settings.ssl_ciphers} if settings.ssl_ciphers else {}),
        # uvicorn's own context, registered for --enable-ssl-refresh in each process
        **({"ssl_context_factory": listener_context} if settings.ssl_certfile else {}),
    }


#: uvicorn's protocol for each --relay (the in-process test servers run the same).
PROTOCOLS = {
    "wire": "proxy.server.wire:WireProtocol",
    "asgi": "proxy.server.protocol:GuardedHttpToolsProtocol",
}


def build_app(settings: Settings) -> ProxyApp:
    """The app with every sink the settings ask for, as a serving process runs it."""
    if settings.relay == "wire":
        # The wire sends every request to the backend on its own pool; the ASGI relay's
        # client then only asks the backend's /v1/models and readiness, on httpx's own
        # transport, so a wire process never imports aiohttp (0.1 s of its start).
        settings = dataclasses.replace(settings, upstream_transport="httpx")
    app = assemble(settings, os.environ)
    app.freeze_heap = True  # proxy/server/heap.py: short full collections
    return app


def app_from_environment() -> ProxyApp:
    """The app configured by the TOKENPROBE_* variables alone (proxy.asgi's, for another
    ASGI server); SettingsError names a bad one."""
    return build_app(parse([], os.environ))


@dataclasses.dataclass(frozen=True)
class WorkerApp:
    """The app factory each worker process runs, holding the settings the parent resolved,
    whole: multiprocessing's spawn pickles it into every worker, and every restarted one.

    Handed over as TOKENPROBE_* variables instead, a setting turned off (None) had no text
    and was skipped, so the worker read the default or a stale variable (`--header-timeout
    0` became 10 s). A worker that cannot build the app says why in one line and exits as
    uvicorn's failed start, which makes its supervisor stop the server rather than start
    the worker again and again."""

    settings: Settings
    supervisor: int = 0  # the parent's process id: a worker ends with it (`_ends_with`)

    def __call__(self) -> ProxyApp:
        _ends_with(self.supervisor)
        _configure_logging(self.settings)  # a spawned worker starts with none of ours
        try:
            return build_app(self.settings)
        except SettingsError as exc:
            print(f"tokenprobe serve: {exc}", file=sys.stderr, flush=True)
            sys.exit(STARTUP_FAILURE)


#: prctl(2)'s option that has the kernel send a signal when the parent dies (linux/prctl.h).
_PR_SET_PDEATHSIG = 1


def _ends_with(supervisor: int) -> None:
    """This worker drains and exits (SIGTERM) when its supervisor dies, as gunicorn's
    workers do: killed with SIGKILL (an OOM kill, `kill -9`), it left its workers serving
    the port with nobody to restart one that died, and a new `serve` on that port refused
    to start. Linux only (prctl); the supervisor's process id tells a parent gone before
    this ran. In a container or a systemd unit the workers die with their group anyway."""
    if not supervisor or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # no libc to ask: as before
        return
    if os.getppid() != supervisor:  # gone already, before the kernel was told
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str]) -> int:
    try:
        settings = parse(argv, os.environ)  # every check runs here (proxy.settings.validate)
        options = uvicorn_options(settings)
        unix = _bind_unix(settings.uds, options)  # kept open while serving
        if unix is None:
            _check_port_free(settings)
        if settings.workers > 1:
            # What each worker's app reads besides the settings, checked once, here: a
            # bad OTEL_* variable refuses the start as it does with one process.
            check_environment(os.environ)
            return _run_workers(settings, options)
        if given := os.environ.get(MULTIPROC_ENV):  # one process, in multiprocess mode
            fresh_metrics_directory(given)  # (assemble.py): its files summed as several's
        app = build_app(settings)
    except SettingsError as exc:
        print(f"tokenprobe serve: {exc}", file=sys.stderr)
        return 2
    except CannotListen as exc:
        print(f"tokenprobe serve: {exc}", file=sys.stderr)
        return STARTUP_FAILURE  # uvicorn's status for a bind that fails
    _configure_logging(settings)
    _say_build()
    _open_files()
    # uvicorn drains on SIGTERM and on SIGINT (Ctrl-C), then raises the signal it caught
    # again; with a handler in place that re-raise is a no-op and a clean drain exits 0, as
    # orchestrators expect, and as uvicorn's own command exits after Ctrl-C. Raised into
    # Python's SIGINT handler, it became asyncio's KeyboardInterrupt once the shutdown was
    # over: a traceback, and the process killed by SIGINT (130 in a shell).
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    server = uvicorn.Server(uvicorn.Config(app, **options))
    signal.signal(signal.SIGHUP, functools.partial(_hang_up, server))
    server.run()
    del unix
    return 0


def _hang_up(server: uvicorn.Server, sig: int, frame: FrameType | None) -> None:
    """SIGHUP to one process (a closed terminal, `systemctl reload`): it ended the process
    at once, every stream cut and none recorded, where with --workers uvicorn replaces the
    workers one by one, each drained. Now it drains as SIGTERM does, then ends the process
    by SIGHUP as before (uvicorn raises the signal it stopped for again, with the default
    action restored here), so a supervisor that restarts a service killed by a signal
    still does. A second SIGHUP during the drain ends it at once."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    server.handle_exit(sig, frame)


class CannotListen(Exception):
    """--port cannot be listened on; the message names the address and why."""


def _check_port_free(settings: Settings) -> None:
    """Refuses a --port that cannot be bound (in use, privileged), in one line naming the
    address, before anything starts. uvicorn binds it only once the app has started (one
    process), so an operator read the app start, then asyncio's words; its worker
    supervisor said only "[Errno 98] Address already in use". Each address is bound as
    uvicorn will bind it, then let go (SO_REUSEADDR, as uvicorn's, leaves no wait behind);
    a port taken in between still fails uvicorn's own bind, as before."""
    host, port = settings.host, settings.port
    if port == 0:  # any free port
        return
    addresses: list[tuple[socket.AddressFamily, Any]]  # (family, what bind takes)
    if settings.workers > 1:  # the supervisor binds one socket (uvicorn's Config.bind_socket)
        addresses = [(socket.AF_INET6 if ":" in host else socket.AF_INET, (host, port))]
    else:  # asyncio's create_server binds each address the host resolves to, v6 alone
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        addresses = [(family, address) for family, *_, address in found]
    for family, address in addresses:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and settings.workers == 1:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                where = f"[{address[0]}]" if family == socket.AF_INET6 else address[0]
                raise CannotListen(
                    f"--port {port}: cannot listen on {where}:{port} ({exc.strerror})"
                ) from None


def _bind_unix(path: str | None, options: dict[str, Any]) -> socket.socket | None:
    """The --uds socket, bound here as vLLM binds its own (launcher.py,
    create_server_unix_socket): its mode comes from the process's umask, where uvicorn's
    own `uds` would make it 0666, open to every local user. A socket file a stopped
    server left is replaced. uvicorn serves it by its descriptor (`fd`)."""
    if path is None:
        return None
    try:
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        unix.bind(path)
    except OSError as exc:
        unix.close()
        raise SettingsError(f"--uds {path}: cannot listen there ({exc.strerror})") from None
    options["fd"] = unix.fileno()
    return unix


def _configure_logging(settings: Settings) -> None:
    """The `tokenprobe` logger's level and format, in the parent and in each worker."""
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _say_build() -> None:
    """Which per-chunk path this process runs (proxy/build.py): an operator comparing
    figures across hosts must know whether the compiled build is the one measured."""
    from proxy.build import describe

    print(f"tokenprobe serve: {describe()}", file=sys.stderr, flush=True)


def _open_files() -> None:
    """Room for as many streams as the backend takes (proxy/openfiles.py): vLLM
    raises its own open-file limit, so a proxy left at a default of 1024 fails every
    stream once about 500 are open at once."""
    limit = raise_open_file_limit()
    if limit is not None:
        print(f"tokenprobe serve: {limit.describe()}", file=sys.stderr, flush=True)


def _run_workers(settings: Settings, options: dict[str, Any]) -> int:
    given = os.environ.get(MULTIPROC_ENV)
    directory = given or tempfile.mkdtemp(prefix="tokenprobe-metrics-")
    fresh_metrics_directory(directory)
    os.environ[MULTIPROC_ENV] = directory
    try:
        return _serve_workers(settings, options)
    finally:
        if not given:  # ours: gone with the server (a given one is the operator's)
            shutil.rmtree(directory, ignore_errors=True)


def _serve_workers(settings: Settings, options: dict[str, Any]) -> int:
    # The salts left unset are drawn here, once, for every worker: drawn in each one, one
    # API key was one `key` label per worker and one prompt one prefix hash per worker.
    if settings.key_label == "hash" and settings.key_salt is None:
        settings = dataclasses.replace(settings, key_salt=secrets.token_hex(16))
    if settings.log_salt is None:
        settings = dataclasses.replace(settings, log_salt=secrets.token_hex(32))
    _configure_logging(settings)
    _say_build()
    _open_files()  # the workers inherit it
    config = worker_config(settings, options)
    supervisor = _Supervisor(config, sockets=[config.bind_socket()])
    with contextlib.suppress(KeyboardInterrupt):
        supervisor.run()
    # A worker that could not start stops them all (uvicorn's rule): say so, as one does.
    failed = any(p.exitcode == STARTUP_FAILURE for p in supervisor.processes)
    return STARTUP_FAILURE if failed else 0


def worker_config(settings: Settings, options: dict[str, Any]) -> uvicorn.Config:
    """uvicorn's configuration of the workers, which carries each its `WorkerApp`."""
    app = WorkerApp(settings, os.getpid())
    return uvicorn.Config(app, factory=True, workers=settings.workers, **options)


class _Supervisor(Multiprocess):
    """uvicorn's worker supervisor (what `uvicorn.run` runs with workers), which stops
    listening first when told to stop: each worker closes its copy of the socket as its
    drain begins, but the parent's kept the port accepting connections no worker would
    ever serve, and new clients hung for the whole drain instead of being refused."""

    def handle_term(self) -> None:
        self._stop_listening()
        super().handle_term()

    def handle_int(self) -> None:
        self._stop_listening()
        super().handle_int()

    def _stop_listening(self) -> None:
        for sock in self.sockets:
            sock.close()
