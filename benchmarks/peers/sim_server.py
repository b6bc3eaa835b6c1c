"""The simulated backend for benchmarks, plus an OTLP sink, in one process.

One port serves several simulators, chosen per request by the `x-bench-step-ms` header,
which every arm forwards unchanged: with it, a lockstep simulator with that decode step
(one chunk per stream per step, created on first use); without it, a free-running one.
All of them stamp each content chunk with its send time, `@<time_ns> ` before its text
(SimConfig.stamp_in_text), so a stream's chunks differ only in their text, as vLLM's do,
and the proxy's template match applies as it does on vLLM's (a `sent_ns` key before the
text, the stamp until 2026-12-05, made every chunk parsed in full). So one simulator
process serves the whole benchmark, streaming sweeps, rate searches and TTFT, whatever
sits in front of it.

The OTLP sink answers every POST with an empty 200 (a valid empty protobuf reply), so a
proxy's trace exporter does its real work without a collector; GET /count says how many
export requests arrived.

    python benchmarks/peers/sim_server.py --port 9000 --otlp-port 4318
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any, Literal

import uvicorn

from proxy.sim.app import SimApp, create_sim_app
from proxy.sim.config import SimConfig

STEP_HEADER = b"x-bench-step-ms"


class Dispatch:
    def __init__(self) -> None:
        self.free = create_sim_app(
            SimConfig(ttft=0.0, stamp=True, stamp_in_text=True, max_records=1000)
        )
        self.lockstep: dict[bytes, SimApp] = {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                await self.free(scope, receive, send)
            return
        app = self.free
        for name, value in scope["headers"]:
            if name == STEP_HEADER:
                app = self.lockstep.get(value) or self._new_lockstep(value)
                break
        await app(scope, receive, send)

    def _new_lockstep(self, step_ms: bytes) -> SimApp:
        config = SimConfig(
            ttft=0.0, stamp=True, stamp_in_text=True, step_ms=float(step_ms), max_records=1000
        )
        app = self.lockstep[step_ms] = create_sim_app(config)
        return app


class OtlpSink:
    def __init__(self) -> None:
        self.exports = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        self.exports += scope["method"] == "POST"
        body = b"%d" % self.exports if scope["method"] == "GET" else b""
        headers = [
            (b"content-type", b"application/x-protobuf"),
            (b"content-length", b"%d" % len(body)),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def serve(port: int, otlp_port: int | None) -> None:
    def server(app: Any, port: int, lifespan: Literal["on", "off"]) -> uvicorn.Server:
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            http="httptools",
            lifespan=lifespan,
            access_log=False,
            log_level="warning",
            backlog=4096,
        )
        return uvicorn.Server(config)

    servers = [server(Dispatch(), port, "on")]
    if otlp_port:
        servers.append(server(OtlpSink(), otlp_port, "off"))
    await asyncio.gather(*(s.serve() for s in servers))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--otlp-port", type=int, default=None)
    args = parser.parse_args()
    import uvloop

    uvloop.run(serve(args.port, args.otlp_port))


if __name__ == "__main__":
    main()
