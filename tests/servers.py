"""Real servers on loopback for tests: an ASGI app on uvicorn, on an ephemeral port, in a
thread of this process (`ThreadedServer`), or `tokenprobe` itself as a process (`spawn`).

Each threaded server runs its own event loop in a daemon thread, like a separate process
would, so a test's client traffic goes over real sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import IO, Any, Protocol, Self, TypeVar

import httpx
import uvicorn

from proxy.bench.ports import free_port

__all__ = [
    "EARLY_ENV",
    "Early",
    "Elsewhere",
    "Started",
    "Starter",
    "ThreadedHypercorn",
    "ThreadedServer",
    "WsLoopThread",
    "accept_each",
    "default_trust",
    "free_port",
    "metrics_port_taken",
    "request_body",
    "serve",
    "serve_in_front",
    "serve_with_a_port_taken",
    "share_the_default_trust",
    "spawn",
    "started",
    "started_early",
    "stop",
    "stop_group",
    "wait_early",
    "wait_http",
]


class _PromptServer(uvicorn.Server):
    """uvicorn's server, stopped when a test says so rather than at its next tick.

    uvicorn notices `should_exit` at a 0.1 s tick, then sleeps 0.1 s and waits for its
    connections and tasks in 0.1 s steps: 0.15-0.3 s a server, two servers a test, most
    of a server test's teardown. Here the tick also ends when `stop` sets `wake`, and the
    shutdown waits for the same things in the same order (uvicorn 0.30-0.55's `shutdown`),
    looking again after 1 ms, then 2, 4, ... up to uvicorn's 0.1 s."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.wake = asyncio.Event()

    async def main_loop(self) -> None:
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.1):
                    await self.wake.wait()
            should_exit = await self.on_tick(counter)

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        for server in self.servers:
            server.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        state = self.server_state
        try:
            async with asyncio.timeout(self.config.timeout_graceful_shutdown):
                for pending in (lambda: state.connections, lambda: state.tasks):
                    pause = 0.001
                    while pending() and not self.force_exit:
                        await asyncio.sleep(pause)
                        pause = min(pause * 2, 0.1)
        except TimeoutError:
            for task in state.tasks:
                task.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
        for server in self.servers:
            await server.wait_closed()
        if not self.force_exit:
            await self.lifespan.shutdown()


class ThreadedServer:
    """uvicorn serving `app` on 127.0.0.1:<ephemeral> in a background thread."""

    def __init__(self, app: Any, **config: Any) -> None:
        self.port = free_port()
        options: dict[str, Any] = {"log_level": "warning", "lifespan": "on", "access_log": False}
        cfg = uvicorn.Config(app, host="127.0.0.1", port=self.port, **{**options, **config})
        self.server = _PromptServer(cfg)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.server.serve())
        finally:
            self.loop.close()

    def start(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server failed to start")
            time.sleep(0.005)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self.loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: it has stopped
                self.loop.call_soon_threadsafe(self.server.wake.set)
        self.thread.join(timeout=10)


class ThreadedHypercorn:
    """hypercorn serving `app` on 127.0.0.1:<ephemeral> in a background thread: the ASGI
    app under a server that is not uvicorn (the app is a product of its own)."""

    def __init__(self, app: Any) -> None:
        from hypercorn.config import Config

        self.port = free_port()
        self.app = app
        self.config = Config()
        self.config.bind = [f"127.0.0.1:{self.port}"]
        self.config.accesslog = None
        self.config.errorlog = None
        self.config.graceful_timeout = 1.0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        from hypercorn.asyncio import serve as hypercorn_serve

        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self._stop = asyncio.Event()
        try:
            self.loop.run_until_complete(
                hypercorn_serve(self.app, self.config, shutdown_trigger=self._stop.wait)
            )
        finally:
            self.loop.close()

    def start(self) -> ThreadedHypercorn:
        self.thread.start()
        wait_http(self.url + "/healthz", timeout=10)
        return self

    def stop(self) -> None:
        if self.loop is not None and self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(timeout=10)


class WsLoopThread:
    """A WebSocket server whose coroutine `_serve` runs on an event loop of its own in a
    daemon thread, on 127.0.0.1:`port` (free when picked): `start` returns once `_serve`
    has set `_ready` (it listens). How `_serve` ends is each server's own `stop`."""

    #: Who did not start, in `start`'s error.
    what = "the WebSocket server"

    def __init__(self) -> None:
        self.port = free_port()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self._serve())
        self.loop.close()

    async def _serve(self) -> None:
        raise NotImplementedError

    def start(self) -> Self:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError(f"{self.what} did not start")
        return self


class _Startable(Protocol):
    def start(self) -> Any: ...
    def stop(self) -> None: ...


_S = TypeVar("_S", bound=_Startable)


@contextlib.contextmanager
def started(server: _S) -> Iterator[_S]:
    """`server` started, and stopped when the block ends."""
    server.start()
    try:
        yield server
    finally:
        server.stop()


def serve(app: Any, **config: Any) -> contextlib.AbstractContextManager[ThreadedServer]:
    return started(ThreadedServer(app, **config))


def accept_each(handle: Callable[[socket.socket], None], backlog: int) -> socket.socket:
    """A socket listening on 127.0.0.1:<ephemeral>, each connection it accepts handed to
    `handle` in a thread of its own, until the socket is closed."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(backlog)

    def accept() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return sock


def read_request(conn: socket.socket, pending: bytes = b"") -> tuple[bytes, bytes, bytes] | None:
    """One request with a Content-Length body from a blocking socket, `pending` being what
    was read of it already: (its head, its body, what came after it); None when the
    connection ends before a whole head."""
    while b"\r\n\r\n" not in pending:
        piece = conn.recv(65536)
        if not piece:
            return None
        pending += piece
    head, _, rest = pending.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    while len(rest) < length:
        piece = conn.recv(65536)
        if not piece:
            return None
        rest += piece
    return head, rest[:length], rest[length:]


# -- `python -m proxy ...` as a real process ---------------------------------------------


def spawn(
    *args: str,
    env: dict[str, str] | None = None,
    stdout: int = subprocess.DEVNULL,
    preexec_fn: Callable[[], None] | None = None,
    stderr: int | IO[bytes] = subprocess.PIPE,
) -> subprocess.Popen[bytes]:
    """`python -m proxy ARGS`; `preexec_fn` runs in the child before it starts (a limit)."""
    return subprocess.Popen(
        [sys.executable, "-m", "proxy", *args],
        env={**os.environ, **(env or {})},
        stdout=stdout,
        stderr=stderr,
        preexec_fn=preexec_fn,
    )


def default_trust() -> ssl.SSLContext:
    """httpx's default TLS trust, made once for each SSL_CERT_FILE and SSL_CERT_DIR.

    httpx makes it anew for every client, reading the whole CA bundle: 21 ms of CPU each
    time on this machine. Most of the suite's clients are one-off GETs of http:// URLs
    that never use it, polling every 20 to 50 ms (`wait_http`, tests.scrape's scrapes):
    about 4,000 of them a run. Made once, the suite took 470 s of CPU where it took 557."""
    return _trust(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))


@functools.lru_cache(maxsize=4)
def _trust(cafile: str | None, capath: str | None) -> ssl.SSLContext:  # the key: what it reads
    return httpx.create_ssl_context()


#: httpx's functions that make a client for their one request.
ONE_REQUEST = ("request", "stream", "get", "options", "head", "post", "put", "patch", "delete")


def share_the_default_trust() -> None:
    """httpx.get, httpx.post and the others of `ONE_REQUEST` take `default_trust()` in
    this process where a call names no trust of its own (no `verify`, no `trust_env`).

    Each makes a client for its one request and, with it, the default trust read from the
    whole CA bundle: 20 ms of CPU here, for http:// URLs that never use it. In
    tests/server, sinks, bench, deploy and sim alone, the tests' own clients made 1,823
    trusts a run, 1,471 of them in these calls (a proxy's request, a scrape, a poll):
    tests/server/test_proxy_e2e.py took 5.0 s of CPU, 2.0 s sharing one. A call that
    names a trust keeps it (a TLS test's CA); the clients the proxy makes in a test's
    process (the ASGI relay's) are not these."""
    for name in ONE_REQUEST:
        function = getattr(httpx, name)
        if not getattr(function, "shares_the_default_trust", False):
            setattr(httpx, name, _with_default_trust(function))


def _with_default_trust(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        if "verify" not in kwargs and "trust_env" not in kwargs:
            kwargs["verify"] = default_trust()
        return function(*args, **kwargs)

    call.shares_the_default_trust = True  # type: ignore[attr-defined]
    return call


def wait_http(url: str, timeout: float = 20.0, verify: ssl.SSLContext | None = None) -> float:
    """Seconds until `url` answers below 500; `verify`: the TLS trust for an https URL
    (httpx's default when None)."""
    trust = verify or default_trust()
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if httpx.get(url, timeout=0.5, verify=trust).status_code < 500:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    raise AssertionError(f"{url} did not come up")


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()


def stop_group(process: subprocess.Popen[bytes] | Elsewhere) -> None:
    """Stops `process` and the process group it leads (its children go with it): SIGTERM,
    then SIGKILL to what is left of the group after 30 s.

    The group is signalled even where its leader has ended: a leader killed with SIGKILL
    (or one that crashed) leaves its children in the group, and a stop that looked only at
    the leader left two `serve --workers` workers running after a failed run."""
    if not _signal_group(process, signal.SIGTERM):
        if process.poll() is None:  # it runs, so it was started without a group of its own
            raise ProcessLookupError(f"process {process.pid} leads no process group")
        return  # the whole group has ended
    if not _group_ends(process, 30):
        _signal_group(process, signal.SIGKILL)
        if not _group_ends(process, 10):
            raise AssertionError(f"process group {process.pid} outlived SIGKILL by 10 s")


def _signal_group(leader: subprocess.Popen[bytes] | Elsewhere, sig: int) -> bool:
    """`sig` sent to each process of the group `leader` leads (0: none, only the check);
    False where none is left.

    killpg reaches the members of a group whose leader has ended, as long as one remains
    (ESRCH only when none does). While one remains, the kernel gives the group's number to
    no new process: so a process that has the leader's pid once the leader was reaped
    means the group is gone, and that process's own group is left alone."""
    if leader.poll() is not None and Path(f"/proc/{leader.pid}").exists():
        return False
    try:
        os.killpg(leader.pid, sig)
    except ProcessLookupError:
        return False
    return True


def _group_ends(leader: subprocess.Popen[bytes] | Elsewhere, timeout: float) -> bool:
    """Whether every process of the group `leader` leads has ended within `timeout` s."""
    deadline = time.monotonic() + timeout
    while _runs_in(leader):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _runs_in(leader: subprocess.Popen[bytes] | Elsewhere) -> bool:
    """Whether a process of the group `leader` leads still runs. killpg's signal 0 also
    finds the ones that have ended and wait to be reaped (a leader until its parent waits
    for it, which `poll` does for ours; the workers of a killed leader until init reaps
    them), so what it finds is looked up in /proc, where a zombie's state is Z."""
    if not _signal_group(leader, 0):
        return False
    proc = Path("/proc")
    if not proc.is_dir():  # no /proc to tell a zombie by: take the group for running
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # it ended while this looked
            continue
        state, _, group = text[text.rfind(")") + 2 :].split()[:3]
        if int(group) == leader.pid and state != "Z":
            return True
    return False


def metrics_port_taken() -> tuple[int, subprocess.CompletedProcess[str]]:
    """A `tokenprobe serve` run to its end with its --metrics-port held by another socket:
    that port, and the process's exit status and output."""
    return serve_with_a_port_taken(
        "--port", "0", "--metrics-port", "{port}", "--models-refresh", "0"
    )


def serve_with_a_port_taken(*flags: str) -> tuple[int, subprocess.CompletedProcess[str]]:
    """A `tokenprobe serve` run to its end with the address `flags` name held by another
    listening socket: that port, and the process's exit status and output. `flags` holds
    `{port}` where the port goes."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "proxy", "serve", "--upstream", "http://127.0.0.1:9",
             *(flag.format(port=port) for flag in flags)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    return port, out


def whole_lines(path: Path) -> list[str]:
    """A log's lines that are whole. A line written while the file is read can be read
    half-written (Linux updates a file's size page by page during a write, and a read
    takes no lock against it: the CI once read a vLLM test's access log line cut short at
    465 characters), so a last line without its newline is left for the next read."""
    text = path.read_text()
    return text[: text.rfind("\n") + 1].splitlines()


def access_records(path: Path, since: int = 0) -> list[dict[str, Any]]:
    """A JSON access log's records from line `since` on (whole lines only)."""
    return [json.loads(line) for line in whole_lines(path)[since:] if line.startswith("{")]


def serve_in_front(
    upstream: str, access_log: Path, what: str
) -> tuple[subprocess.Popen[bytes], str]:
    """A `tokenprobe serve` in front of `upstream` with its JSON access log in
    `access_log`, alive and answering its own /healthz with 200; returns it and its URL.

    A free port is only free when it is picked: another process (an engine server's
    helpers, another proxy) can take it before this proxy binds it, and then the proxy
    exits while its URL answers for someone else (vLLM answers /healthz with a 404, which
    a plain wait would take for "up"). So it must be alive and answer its own /healthz;
    otherwise it gets another port. `what` names the upstream in the failure."""
    for _ in range(5):
        port = free_port()
        with access_log.open("wb") as out:
            proxy = spawn(
                "serve", "--upstream", upstream, "--port", str(port), "--access-log", "json",
                stdout=out.fileno(),
            )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while proxy.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        if proxy.poll() is None and httpx.get(url + "/healthz", timeout=2).status_code == 200:
            return proxy, url
        stop(proxy)
    raise AssertionError(f"tokenprobe serve in front of {what} did not start")


async def request_body(receive: Callable[[], Awaitable[dict[str, Any]]]) -> bytes:
    """An ASGI test backend's whole request body, from its `receive`."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


def echoing(
    text: Callable[[dict[str, Any], dict[bytes, bytes]], bytes], status: int = 403
) -> Callable[..., Awaitable[None]]:
    """An ASGI backend that answers every request `status` with `text(scope, headers)`:
    one that repeats the caller's credentials in its error text."""

    async def app(scope: dict[str, Any], receive: Callable, send: Callable) -> None:  # type: ignore[type-arg]
        if scope["type"] != "http":
            return
        await receive()
        body = text(scope, dict(scope["headers"]))
        start = {"type": "http.response.start", "status": status}
        await send({**start, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": body})

    return app


# -- processes started early, for a worker's module fixture ------------------------------

#: The folder in which the first pytest process of a parallel run starts processes early
#: (`Early`); the workers inherit it. Unset in a serial run.
EARLY_ENV = "TOKENPROBE_EARLY"

#: What an early start gives: the processes started, and what the fixture needs to know of
#: them (JSON).
Started = tuple[list[subprocess.Popen[bytes]], dict[str, Any]]
#: What starts one early process (or several) in the folder it is given; None: nothing to
#: start here (the fixture starts it, or skips).
Starter = Callable[[Path], Started | None]


class Early:
    """Processes that the first pytest process of a parallel run starts as soon as a worker
    has collected, for the module fixtures that would otherwise start them and wait: a vLLM
    loads for a minute, the relay benchmark runs for one and a half. Meanwhile the worker
    that will run the module runs others (tests/conftest.py names the modules and their
    starters, and hands those modules out after the longer ones).

    A thread waits on each process and writes its return code where a worker reads it
    (`Elsewhere`). A process the fixture did not stop is stopped at the end of the run,
    with its process group: each is started in a group of its own, so that its children go
    down with it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.begun = False
        self._processes: list[subprocess.Popen[bytes]] = []

    def start(self, starter: Starter) -> None:
        """Run `starter`; a failure leaves the fixture to start the process itself, and
        to fail there, in a test, if it fails again."""
        name = starter.__name__
        try:
            started = starter(self.folder / name)
        except Exception as exc:  # the fixture's own start says what failed
            _write_whole(self.folder / f"{name}.failed", repr(exc))
            return
        if started is None:
            return
        processes, details = started
        for process in processes:
            self._processes.append(process)
            threading.Thread(target=self._reap, args=(process,), daemon=True).start()
        _write_whole(self.folder / f"{name}.json", json.dumps({
            **details, "pids": [process.pid for process in processes]
        }))  # fmt: skip

    def _reap(self, process: subprocess.Popen[bytes]) -> None:
        _write_whole(self.folder / f"{process.pid}.returncode", str(process.wait()))

    def stop(self) -> None:
        """Every group told to stop before any is waited for; a group whose leader has
        ended is stopped too, for the children it left (`stop_group`)."""
        stopping = [p for p in self._processes if _signal_group(p, signal.SIGTERM)]
        for process in stopping:
            if not _group_ends(process, 30):
                _signal_group(process, signal.SIGKILL)
                _group_ends(process, 10)
        shutil.rmtree(self.folder, ignore_errors=True)


class Elsewhere:
    """A process that another pytest process started and waits on (`Early`), as a worker
    sees it: `pid`, `poll`, `wait` and `returncode` as a Popen's, the code read from the
    file that process writes when it ends."""

    def __init__(self, pid: int, returncode_file: Path) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._file = returncode_file

    def poll(self) -> int | None:
        if self.returncode is None and self._file.exists():
            self.returncode = int(self._file.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
            time.sleep(0.05)
        return code


def started_early(starter: Starter) -> tuple[dict[str, Any], list[Elsewhere]] | None:
    """On a worker: what `Early` started with `starter`, and its processes; None where
    nothing was (a serial run, a module not selected, a start that failed)."""
    folder = os.environ.get(EARLY_ENV)
    found = Path(folder) / f"{starter.__name__}.json" if folder else None
    if found is None or not found.is_file():
        return None
    details = json.loads(found.read_text())
    processes = [Elsewhere(pid, found.parent / f"{pid}.returncode") for pid in details["pids"]]
    return details, processes


def wait_early(early: tuple[dict[str, Any], list[Elsewhere]]) -> tuple[Path, int]:
    """The folder and the exit status of the one process `started_early` found, once it
    has ended; past the deadline its starter gave, it is killed with its process group
    and this raises subprocess.TimeoutExpired."""
    details, (process,) = early
    try:
        returncode = process.wait(max(details["deadline"] - time.time(), 0))
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        raise
    return Path(details["out"]), returncode


def _write_whole(path: Path, text: str) -> None:
    """`text` in `path`, whole for a reader at any moment."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    partial.replace(path)
