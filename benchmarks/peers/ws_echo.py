"""WebSocket echo, for the WebSocket arms of relay.py: a backend and a client load.

    python benchmarks/peers/ws_echo.py serve --port 9100
    python benchmarks/peers/ws_echo.py client --port 9100 --path /ws --sessions 50 --duration 3

The backend is an ASGI app on uvicorn: every WebSocket message comes back as it came, and
any HTTP request gets a tiny chat completion, so a proxy in front can start, answer its
readiness probe and then tunnel `/ws`. The client opens `--sessions` sessions at once
(the `websockets` package), each sending a small text message and waiting for its echo,
back to back, until `--duration`; it prints one JSON line: messages echoed, sessions that
completed, errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

CHAT = json.dumps(
    {
        "id": "chatcmpl-ws",
        "object": "chat.completion",
        "created": 1764547200,
        "model": "sim-model",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()
MODELS = b'{"object":"list","data":[{"id":"sim-model","object":"model"}]}'


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "websocket":
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        while True:
            message = await receive()
            if message["type"] != "websocket.receive":
                return
            await send({"type": "websocket.send", "text": message.get("text"), "bytes": message.get("bytes")})  # fmt: skip
    elif scope["type"] == "http":
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        body = MODELS if scope["path"].endswith("/models") else CHAT
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
    elif scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return


async def client(port: int, path: str, sessions: int, duration: float, size: int) -> dict[str, Any]:
    from websockets.asyncio.client import connect

    payload = "x" * size
    deadline = time.monotonic() + duration
    counts = {"messages": 0, "completed": 0, "errors": 0}
    reasons: dict[str, int] = {}

    async def session() -> None:
        try:
            async with connect(f"ws://127.0.0.1:{port}{path}", compression=None) as ws:
                while time.monotonic() < deadline:
                    await ws.send(payload)
                    if await ws.recv() != payload:
                        raise ValueError("the echo differs")
                    counts["messages"] += 1
            counts["completed"] += 1
        except Exception as exc:  # a refused upgrade or a broken tunnel: counted, reported
            counts["errors"] += 1
            reason = f"{type(exc).__name__}: {exc}"[:120]
            reasons[reason] = reasons.get(reason, 0) + 1

    t0 = time.monotonic()
    await asyncio.gather(*(session() for _ in range(sessions)))
    return {**counts, "sessions": sessions, "wall_s": time.monotonic() - t0, "reasons": reasons}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("serve", "client"))
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--path", default="/ws")
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--size", type=int, default=32, help="bytes per message")
    args = parser.parse_args()
    import uvloop

    if args.mode == "serve":
        import uvicorn

        config = uvicorn.Config(
            app, host="127.0.0.1", port=args.port, ws="websockets-sansio", log_level="warning",
            access_log=False, backlog=4096, ws_per_message_deflate=False,
        )  # fmt: skip
        uvloop.run(uvicorn.Server(config).serve())
    else:
        result = uvloop.run(client(args.port, args.path, args.sessions, args.duration, args.size))
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
