"""The replay's parts alone: reading logs, cutting windows, Mooncake ids, the wire client."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.bench.options import OptionsError
from proxy.bench.replay import window
from proxy.bench.synth import close_enough
from proxy.bench.trace import SHOW_SKIPPED, Want, read_logs, to_mooncake
from tests.bench.test_bench import bench
from tests.conftest import Running


def line(**changes: Any) -> bytes:
    base = {
        "ts": "2026-01-01T00:00:00.000Z",
        "arrival": 100.0,
        "endpoint": "/v1/chat/completions",
        "model": "m",
        "stream": True,
        "prompt_tokens": 100,
        "output_tokens": 20,
        "max_tokens": 32,
        "prefix": ["aa", "bb"],
        "prefix_chars": [50, 100],
        "prompt_chars": 100,
    }
    return orjson.dumps({**base, **changes}) + b"\n"


def test_lines_that_are_not_replayable_records_are_skipped_counted_and_named(tmp_path: Path) -> None:  # fmt: skip
    log = tmp_path / "a.log"
    bad = [
        b"INFO: server started\n",
        b'{"ts": "2026", "endpoint": "/v1/chat/comp\n',  # truncated
        b'{"level": "info", "msg": "hello"}\n',  # JSON, not a record
        line(endpoint="/v1/embeddings"),
        line(arrival=None),
        line(prompt_tokens=None),
        b"pod-7 | " + line(arrival=101.5),  # a collector's prefix is fine
    ]
    log.write_bytes(line() + b"".join(bad) + line(arrival=100.25, output_tokens=None))
    wants, skipped = read_logs([str(log)])
    assert [w.offset for w in wants] == [0.0, 0.25, 1.5]
    assert wants[1].output_tokens == 32  # no output count: its limit
    assert skipped.count == 6 and len(skipped.where) == min(6, SHOW_SKIPPED)
    assert skipped.where[0] == f"{log}:2"
    assert skipped.reasons["not a replayable API"] == 1
    assert (
        skipped.reasons["no arrival instant"] == 1 and skipped.reasons["no prompt token count"] == 1
    )


def test_only_prefixes_reached_by_two_requests_are_kept_with_one_length_each(tmp_path: Path) -> None:  # fmt: skip
    log = tmp_path / "a.log"
    log.write_bytes(
        line(prefix=["s", "x"], prefix_chars=[40, 100], prompt_tokens=100)
        + line(arrival=101.0, prefix=["s", "y"], prefix_chars=[40, 200], prompt_chars=200, prompt_tokens=200)
        + line(arrival=102.0, prefix=["t"], prefix_chars=[10], prompt_tokens=50)
    )  # fmt: skip
    wants, _ = read_logs([str(log)])
    assert wants[0].chain == wants[1].chain == (("s", 40),)  # 40% of the first request's 100
    assert wants[2].chain == ()


def test_window_shifts_offsets_and_max_requests_cuts() -> None:
    wants = [Want(t, "/v1/chat/completions", "m", True, 10, 5) for t in (0.0, 5.0, 10.0, 15.0)]
    assert [w.offset for w in window(wants, "5,15", None)] == [0.0, 5.0]
    assert len(window(wants, None, 3)) == 3
    with pytest.raises(OptionsError, match="--window"):
        window(wants, "9,3", None)


def test_mooncake_ids_are_shared_exactly_as_far_as_the_prefix_nodes() -> None:
    a = Want(0.0, "/v1/completions", "m", False, 1300, 10, (("s", 600), ("h", 1100)))
    b = Want(0.5, "/v1/completions", "m", False, 1200, 10, (("s", 600), ("h", 1100)))
    c = Want(1.0, "/v1/completions", "m", False, 700, 10, (("s", 600),))
    d = Want(1.5, "/v1/completions", "m", False, 100, 10)
    ea, eb, ec, ed = to_mooncake([a, b, c, d], block=512)
    assert ea["hash_ids"][:2] == eb["hash_ids"][:2] and ea["hash_ids"][2] != eb["hash_ids"][2]
    assert ec["hash_ids"][0] == ea["hash_ids"][0] and ec["hash_ids"][1] != ea["hash_ids"][1]
    assert len(ed["hash_ids"]) == 1 and ed["hash_ids"][0] not in ea["hash_ids"]
    assert (ea["timestamp"], eb["timestamp"], ea["input_length"]) == (0, 500, 1300)


@pytest.mark.parametrize(("got", "want", "ok"), [(103, 100, True), (104, 100, False), (1030, 1000, True), (1031, 1000, False)])  # fmt: skip
def test_close_enough_is_three_percent_or_three_tokens(got: int, want: int, ok: bool) -> None:
    assert close_enough(got, want) is ok


# -- the protocol-level client's failures --------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "expected"),
    [("stall", "upstream_timeout"), ("reset", "stream_truncated"), ("close_no_done", "stream_truncated")],
)  # fmt: skip
def test_wire_client_names_broken_streams(
    start_sim: Callable[..., Running], tmp_path: Path, capsys: pytest.CaptureFixture[str], fault: str, expected: str
) -> None:  # fmt: skip
    sim = start_sim(ttft=0.01, tokens_per_second=500)
    # Only the stall needs a short read timeout; the cut streams end at once, and a short one there
    # turned a loaded machine's scheduling gap into upstream_timeout (a CI run).
    timeout = "0.5" if fault == "stall" else "10"
    flags = ["--header", f"x-sim-fault: {fault}", "--header", "x-sim-fault-after: 2",
             "--header", "x-sim-stall: 3", "--timeout", timeout, "--requests", "2", "--max-tokens", "8"]  # fmt: skip
    _, doc, _, _ = bench(capsys, sim.url + "/v1", tmp_path / "r.json", *flags)
    assert {r["error_type"] for r in doc["records"]} == {expected}, doc["records"][0][
        "error_message"
    ]
    assert all(r["ttft"] is not None for r in doc["records"])  # content came before the fault


def test_wire_client_reuses_connections_between_requests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    from proxy.sim.app import create_sim_app
    from proxy.sim.config import SimConfig
    from tests.conftest import MODEL
    from tests.servers import serve

    sim = create_sim_app(SimConfig(models=(MODEL,), ttft=0.0, tokens_per_second=2000))
    clients: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            clients.append(tuple(scope["client"]))
        await sim(scope, receive, send)

    with serve(app) as server:
        _, doc, _, _ = bench(capsys, server.url + "/v1", tmp_path / "r.json", "--requests", "6", "--max-tokens", "4")  # fmt: skip
    assert [r["error_type"] for r in doc["records"]] == [None] * 6
    assert len(clients) == 6 and len(set(clients)) == 1  # one keep-alive connection


def test_progress_line_says_sent_due_done_and_errors() -> None:
    import io
    from time import perf_counter

    from proxy.bench.client import Result
    from proxy.bench.load import Level
    from proxy.bench.progress import ReplayProgress
    from proxy.core.measurement import ErrorType
    from tests.factories import measurement

    out = io.StringIO()
    progress = ReplayProgress(3, enabled=True, stream=out)
    progress.start()
    progress.began = perf_counter() - 10  # ten seconds in: two of three requests are due
    progress.schedule = [0.0, 1.0, 100.0]
    level = Level(0, 1.0, "replay")
    for m in (measurement(), measurement(error_type=ErrorType.RATE_LIMIT, status_code=429)):
        progress.sent()
        progress.result(level, Result(0, 0, 0.0, 0.0, m))
    progress.close()
    assert out.getvalue().startswith("[replay] 2 sent / 2 due of 3, 2 done, 1 errors, 10s")


def test_model_map_window_and_max_requests_shape_the_workload(tmp_path: Path) -> None:
    from proxy.bench.replay import _workload, parser

    log = tmp_path / "a.log"
    log.write_bytes(b"".join(line(arrival=100.0 + t, model=m) for t, m in ((0, "a"), (1, "b"), (2, "a"), (3, "c"))))  # fmt: skip
    ns = parser().parse_args([str(log), "--url", "http://x", "--model-map", "a=A", "--model-map", "b=B", "--window", "1,4", "--max-requests", "2"])  # fmt: skip
    wants, skipped = _workload(ns)
    assert skipped.count == 0
    assert [(w.offset, w.model) for w in wants] == [(0.0, "B"), (1.0, "A")]


def test_wire_client_reads_a_body_that_ends_with_the_connection() -> None:
    """HTTP/1.0-style: no Content-Length, no chunking; the body is everything until close."""
    import asyncio
    import socket
    import threading
    from time import perf_counter

    import yarl

    from proxy.bench.wire import Pool, request_head
    from proxy.core.apis import RequestInfo
    from proxy.core.observe import StreamObserver

    events = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n'
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def answer() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n" + events)
        conn.close()

    threading.Thread(target=answer, daemon=True).start()
    url = yarl.URL(f"http://127.0.0.1:{listener.getsockname()[1]}/v1/chat/completions")
    info = RequestInfo("/v1/chat/completions", "m", True, True, 4, 0.0)

    async def go() -> StreamObserver:
        pool = Pool(url, timeout=5)
        observer = StreamObserver(info, perf_counter())
        assert await pool.request(request_head(url, {}, 2), b"{}", observer) == 200
        pool.close()
        return observer

    observer = asyncio.run(go())
    listener.close()
    assert observer.content_events == 1 and observer.first_token is not None


def test_wire_client_sends_again_on_a_new_connection_when_a_kept_alive_one_was_closed() -> None:
    """llama.cpp's server answers a stream with Keep-Alive, then closes the connection: the
    next request on it meets the close before its answer's head and goes once more."""
    import asyncio
    import socket
    import threading
    from time import perf_counter

    import yarl

    from proxy.bench.wire import Pool, request_head
    from proxy.core.apis import RequestInfo
    from proxy.core.observe import StreamObserver

    events = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n'
    answer = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n"
        b"keep-alive: timeout=5, max=100\r\n\r\n%s" % (len(events), events)
    )
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    connections: list[int] = []

    def serve() -> None:
        for _ in range(3):
            conn, _ = listener.accept()
            connections.append(1)
            conn.recv(65536)
            conn.sendall(answer)
            conn.recv(65536)  # the next request on this connection: closed unanswered
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    url = yarl.URL(f"http://127.0.0.1:{listener.getsockname()[1]}/v1/chat/completions")
    info = RequestInfo("/v1/chat/completions", "m", True, True, 4, 0.0)

    async def go() -> list[StreamObserver]:
        pool = Pool(url, timeout=5)
        observers = []
        for _ in range(3):
            observer = StreamObserver(info, perf_counter())
            assert await pool.request(request_head(url, {}, 2), b"{}", observer) == 200
            observers.append(observer)
        pool.close()
        return observers

    observers = asyncio.run(go())
    listener.close()
    assert len(connections) == 3
    assert all(o.content_events == 1 and o.done for o in observers)
