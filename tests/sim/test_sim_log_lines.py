"""`tokenprobe sim --log-level info` logs each WebSocket handshake it answers (uvicorn's
line) with its path, never its query, which can carry a key (`?api_key=`)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from proxy.core.uvicorn_logs import UVICORN_ERROR, WebSocketPathOnly, keep_queries_out_of_logs
from tests.servers import free_port, spawn, stop, wait_http


async def handshake(url: str, key: str | None) -> int:
    """The handshake's status: 101 once the session opened (its first event read)."""
    headers = {} if key is None else {"authorization": f"Bearer {key}"}
    try:
        async with connect(url, additional_headers=headers, open_timeout=30) as ws:
            await asyncio.wait_for(ws.recv(), 30)
            return 101
    except InvalidStatus as refused:
        return refused.response.status_code


def test_each_handshake_line_keeps_its_path_and_not_its_query(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "sim.log"
    with log.open("wb") as err:
        sim = spawn(
            "sim", "--port", str(port), "--log-level", "info", "--api-key", "good", stderr=err
        )
    try:
        wait_http(f"http://127.0.0.1:{port}/health")
        base = f"ws://127.0.0.1:{port}"
        # uvicorn's three lines: accepted, refused with a status of the app's (vLLM's 401
        # to an upgrade without the key), refused by a close before accepting (403)
        got = [
            asyncio.run(handshake(base + "/v1/realtime?api_key=CANARYWSQ13&x=1", "good")),
            asyncio.run(handshake(base + "/v1/realtime?access_token=CANARYWSQ14", None)),
            asyncio.run(handshake(base + "/other?key=CANARYWSQ15", "good")),
        ]
    finally:
        stop(sim)
    assert got == [101, 401, 403]
    text = log.read_text()
    assert '"WebSocket /v1/realtime?[query]" [accepted]' in text, text
    assert '"WebSocket /v1/realtime?[query]" 401' in text, text
    assert '"WebSocket /other?[query]" 403' in text, text
    assert "CANARY" not in text


def test_the_filter_is_installed_once_however_often_the_simulator_starts() -> None:
    logger = logging.getLogger(UVICORN_ERROR)
    before = list(logger.filters)
    try:
        keep_queries_out_of_logs()
        keep_queries_out_of_logs()
        assert sum(isinstance(f, WebSocketPathOnly) for f in logger.filters) == 1
    finally:
        logger.filters[:] = before
