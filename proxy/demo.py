"""`tokenprobe demo`: the simulated backend, the proxy in front of it, and a little traffic.

Everything runs in this one process on loopback: the simulator on an ephemeral port, the
proxy on --port (4000). The traffic shows each kind of outcome the proxy tells apart; the
table printed afterwards comes from the proxy's own measurement records, and /metrics is
live for as long as the demo keeps serving.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import itertools
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import uvicorn

from proxy.bench.ports import free_port
from proxy.core.measurement import Measurement
from proxy.core.wav import pcm16, wav
from proxy.server.assemble import assemble
from proxy.server.serve import uvicorn_options
from proxy.settings import Settings
from proxy.sim.app import create_sim_app
from proxy.sim.cli import port_number  # the simulator's --port type: out of range, a usage error
from proxy.sim.config import SimConfig
from proxy.sinks.sink import Recorder

MODEL = "sim-model"


@dataclass(frozen=True)
class Scenario:
    name: str
    stream: bool = True
    endpoint: str = "/v1/chat/completions"
    headers: tuple[tuple[str, str], ...] = ()
    max_tokens: int = 48


SCENARIOS = (
    Scenario("fast stream", headers=(("x-sim-ttft", "0.08"), ("x-sim-tps", "120"))),
    Scenario("slow prefill", headers=(("x-sim-ttft", "0.6"), ("x-sim-tps", "60"))),
    Scenario(
        "slow decode",
        headers=(("x-sim-ttft", "0.1"), ("x-sim-tps", "15"), ("x-sim-output-tokens", "20")),
    ),
    Scenario("cut off by max_tokens", max_tokens=12, headers=(("x-sim-output-tokens", "40"),)),
    Scenario("text completion", endpoint="/v1/completions", headers=(("x-sim-ttft", "0.1"),)),
    Scenario(
        "non-streaming",
        stream=False,
        headers=(("x-sim-ttft", "0.1"), ("x-sim-output-tokens", "16")),
    ),
    Scenario("context too long", max_tokens=1_000_000),
    Scenario("bad API key", headers=(("x-sim-error", "auth"),)),
    Scenario("token exchange failed", headers=(("x-sim-error", "token_exchange"),)),
    Scenario("rate limited", headers=(("x-sim-error", "rate_limit"),)),
    Scenario(
        "error mid-stream", headers=(("x-sim-fault", "error_event"), ("x-sim-fault-after", "5"))
    ),
    Scenario(
        "stream cut short", headers=(("x-sim-fault", "close_no_done"), ("x-sim-fault-after", "5"))
    ),
    # One row per other API the proxy measures (proxy/core/apis/).
    Scenario("anthropic messages", endpoint="/v1/messages", headers=(("x-sim-ttft", "0.1"),)),
    Scenario(
        "messages max_tokens",
        endpoint="/v1/messages",
        max_tokens=8,
        headers=(("x-sim-output-tokens", "40"),),
    ),
    Scenario("openai responses", endpoint="/v1/responses", headers=(("x-sim-ttft", "0.1"),)),
    Scenario("responses, not streamed", endpoint="/v1/responses", stream=False),
    Scenario("embeddings", endpoint="/v1/embeddings", stream=False),
    Scenario("pooling", endpoint="/pooling", stream=False),
    Scenario("score", endpoint="/score", stream=False),
    Scenario("rerank", endpoint="/v2/rerank", stream=False),
    Scenario("classify", endpoint="/classify", stream=False),
    Scenario(
        "generate, token ids", endpoint="/inference/v1/generate", headers=(("x-sim-ttft", "0.1"),)
    ),
    Scenario(
        "audio transcription",
        endpoint="/v1/audio/transcriptions",
        headers=(("x-sim-ttft", "0.15"), ("x-sim-output-tokens", "12")),
    ),
    Scenario(
        "audio translation",
        endpoint="/v1/audio/translations",
        stream=False,
        headers=(("x-sim-output-tokens", "12"),),
    ),
    Scenario("cohere chat v2", endpoint="/cohere/v2/chat", headers=(("x-sim-ttft", "0.1"),)),
    # Ollama's native API (NDJSON); the first row loads its model cold.
    Scenario(
        "ollama chat, cold load",
        endpoint="/api/chat",
        headers=(("x-sim-ttft", "0.1"), ("x-sim-load-time", "0.5")),
    ),
    Scenario("ollama generate", endpoint="/api/generate", headers=(("x-sim-ttft", "0.1"),)),
    # llama.cpp's server: its timings move to the usage chunk the proxy asks for, and back.
    Scenario(
        "llama.cpp chat, timings",
        headers=(("x-sim-ttft", "0.1"), ("x-sim-backend-kind", "llamacpp")),
    ),
)
#: Half a second of audio, as a WAV file, for the audio rows.
WAV = wav(0.5)


def _request(s: Scenario, i: int) -> dict[str, Any]:
    """httpx's keyword arguments for request `i` of a scenario: a JSON body, or a form."""
    if s.endpoint.startswith("/v1/audio/"):
        data = {"model": MODEL, "stream": "true" if s.stream else "false"}
        return {"files": {"file": ("speech.wav", WAV, "audio/wav")}, "data": data}
    return {"json": _body(s, i)}


def _body(s: Scenario, i: int) -> dict[str, object]:
    text = f"Tell me about measuring latency ({i})."
    if s.endpoint in _POOLING_BODIES:
        return {"model": MODEL, **_POOLING_BODIES[s.endpoint](text)}
    body: dict[str, object] = {"model": MODEL, "stream": s.stream}
    if s.endpoint == "/inference/v1/generate":
        ids = [1 + (i + n) % 1000 for n in range(16)]
        body.update(token_ids=ids, sampling_params={"max_tokens": s.max_tokens})
        return body
    if s.endpoint == "/v1/responses":
        body.update(input=text, max_output_tokens=s.max_tokens)
        return body
    if s.endpoint.startswith("/api/"):  # Ollama: the limit is an option
        key, value = ("prompt", text) if s.endpoint == "/api/generate" else ("messages", None)
        body.update({key: value or [{"role": "user", "content": text}]})
        body["options"] = {"num_predict": s.max_tokens}
        return body
    body["max_tokens"] = s.max_tokens
    if s.endpoint == "/v1/completions":
        body["prompt"] = f"Write a haiku about request number {i}."
    else:
        body["messages"] = [{"role": "user", "content": text}]
    return body


_POOLING_BODIES: dict[str, Callable[[str], dict[str, object]]] = {
    "/v1/embeddings": lambda text: {"input": text},
    "/pooling": lambda text: {"input": text},
    "/classify": lambda text: {"input": text},
    "/score": lambda text: {"text_1": text, "text_2": "latency"},
    "/v2/rerank": lambda text: {"query": "latency", "documents": [text, "throughput"]},
}


async def _traffic(base: str, rounds: int, records: list[Measurement]) -> dict[int, str]:
    """Each scenario's requests run together; returns record index -> scenario name."""
    names: dict[int, str] = {}
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        for s in SCENARIOS:
            first = len(records)
            await asyncio.gather(
                *(
                    client.post(s.endpoint, **_request(s, i), headers=dict(s.headers))
                    for i in range(rounds)
                ),
                return_exceptions=True,
            )
            await asyncio.sleep(0.05)  # the record lands just after the last byte
            names.update((i, s.name) for i in range(first, len(records)))
    return names


def _websockets() -> Callable[..., Any] | None:
    """The WebSocket client for the realtime row, None where it is not installed."""
    try:
        from websockets.asyncio.client import connect  # comes with uvicorn[standard]
    except ImportError:
        return None
    return connect


async def _realtime(base: str, rounds: int, records: list[Measurement]) -> dict[int, str]:
    """One /v1/realtime session through the proxy, one utterance a round: audio appended,
    a commit that starts the transcription, the rest of the audio, the final commit."""
    connect = _websockets()
    if connect is None or rounds < 1:
        return {}
    first = len(records)
    audio = base64.b64encode(pcm16(0.5)).decode()
    events = [
        {"type": "input_audio_buffer.append", "audio": audio},
        {"type": "input_audio_buffer.commit"},
        {"type": "input_audio_buffer.append", "audio": audio},
        {"type": "input_audio_buffer.commit", "final": True},
    ]
    headers = {"x-sim-ttft": "0.12", "x-sim-output-tokens": "10"}
    url = base.replace("http://", "ws://") + "/v1/realtime"
    async with connect(url, additional_headers=headers) as ws:
        await ws.recv()  # session.created
        await ws.send(orjson.dumps({"type": "session.update", "model": MODEL}).decode())
        for _ in range(rounds):
            for event in events:
                await ws.send(orjson.dumps(event).decode())
            while "transcription.done" not in str(await ws.recv()):
                pass
    await asyncio.sleep(0.05)  # the session's records land as it closes
    return {i: "realtime utterance" for i in range(first, len(records))}


async def _keep_busy(base: str) -> None:
    """A few requests a second, mostly successes, so the live view has something to show."""
    mix = (*SCENARIOS[:3], *SCENARIOS[:3], *SCENARIOS)
    pending: set[asyncio.Task[httpx.Response]] = set()  # held, so none is collected mid-flight

    def done(task: asyncio.Task[httpx.Response]) -> None:
        pending.discard(task)
        if not task.cancelled():
            task.exception()  # a failed request is shown by the proxy; nothing to raise here

    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        for i in itertools.count():
            s = mix[i % len(mix)]
            task = asyncio.create_task(
                client.post(s.endpoint, **_request(s, i), headers=dict(s.headers))
            )
            pending.add(task)
            task.add_done_callback(done)
            await asyncio.sleep(0.25)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _table(records: list[Measurement], names: dict[int, str]) -> str:
    head = f"{'':24} {'endpoint':24} {'ttft ms':>8} {'tpot ms':>8} {'tok/s':>6} {'e2e ms':>7} {'out':>4} {'source':>9} {'finish':>8} {'load ms':>7}  outcome"
    lines = [head, "-" * len(head)]
    for i, m in enumerate(records):
        speed = "-" if m.decode_tokens_per_second is None else f"{m.decode_tokens_per_second:.0f}"
        out = "-" if m.output_tokens is None else str(m.output_tokens)
        outcome = m.error_type.value if m.error_type else "ok"
        load = None if m.engine is None else m.engine.load_time  # Ollama's load_duration
        lines.append(
            f"{names.get(i, m.endpoint)[:24]:24} {m.endpoint:24} {_ms(m.ttft):>8} {_ms(m.tpot):>8} {speed:>6} "
            f"{_ms(m.e2e):>7} {out:>4} {m.token_source.value:>9} {m.finish_reason:>8} {_ms(load):>7}  {outcome}"
        )
    return "\n".join(lines)


async def run(port: int, rounds: int, serve_after: bool, out: object = sys.stdout) -> int:
    recorder = Recorder()
    records = recorder.records
    sim_port = free_port()
    sim = uvicorn.Server(
        uvicorn.Config(
            create_sim_app(SimConfig(models=(MODEL,))),
            host="127.0.0.1",
            port=sim_port,
            log_level="warning",
        )
    )
    settings = Settings(
        upstream=f"http://127.0.0.1:{sim_port}",
        host="127.0.0.1",
        port=port,
        model_allowlist=(MODEL,),
        models_refresh=None,
        access_log="off",  # the table below shows the records instead
    )
    app = assemble(settings, {}, extra_sinks=[recorder])
    proxy = uvicorn.Server(
        uvicorn.Config(
            app,
            **{**uvicorn_options(settings), "log_level": "warning"},  # the wire, as serve runs
        )
    )
    tasks = [asyncio.create_task(sim.serve()), asyncio.create_task(proxy.serve())]
    while not (sim.started and proxy.started):
        if any(t.done() for t in tasks):
            print(
                f"tokenprobe demo: could not start (is port {port} free? try --port 0)",
                file=sys.stderr,
            )
            return 1
        await asyncio.sleep(0.02)
    port = proxy.servers[0].sockets[0].getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    if serve_after:
        print(f"live view                {base}/ui   (open in a browser)", file=out)  # type: ignore[call-overload]
    print(f"simulated vLLM backend   http://127.0.0.1:{sim_port}/v1", file=out)  # type: ignore[call-overload]
    print(f"tokenprobe proxy         {base}/v1   (clients point here)", file=out)  # type: ignore[call-overload]
    per_round = len(SCENARIOS) + (_websockets() is not None)  # the realtime utterance
    print(f"\nsending {rounds} round(s) of {per_round} requests through the proxy...\n", file=out)  # type: ignore[call-overload]
    names = await _traffic(base, rounds, records)
    names.update(await _realtime(base, rounds, records))
    print(_table(records, names), file=out)  # type: ignore[call-overload]
    if serve_after:  # the hints only while there is a proxy to curl
        print(
            f"\nmetrics:   curl {base}/metrics | grep '^tokenprobe_'\n"
            f"try it:    curl -N {base}/v1/chat/completions -H 'content-type: application/json' "
            f"""-d '{{"model":"{MODEL}","stream":true,"messages":[{{"role":"user","content":"hi"}}]}}'""",
            file=out,  # type: ignore[call-overload]
        )
        print(f"\nserving until Ctrl-C, with light traffic; watch {base}/ui", file=out)  # type: ignore[call-overload]
        tasks.append(asyncio.create_task(_keep_busy(base)))
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks)
    else:
        async with httpx.AsyncClient() as client:
            metrics = (await client.get(f"{base}/metrics")).text
        total = sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("tokenprobe_requests_total{")
        )
        print(f"\n/metrics counted {total:.0f} measured requests", file=out)  # type: ignore[call-overload]
        print("the proxy stops now: rerun with --serve to keep it running", file=out)  # type: ignore[call-overload]
    proxy.should_exit = sim.should_exit = True
    await asyncio.gather(*tasks, return_exceptions=True)
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tokenprobe demo", description=__doc__)
    parser.add_argument(
        "--port",
        type=port_number,
        default=4000,
        help="proxy port (default: %(default)s; 0: any free port)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="rounds of traffic to send, each request of every kind once a round "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--serve", action="store_true", help="keep serving after the traffic, until Ctrl-C"
    )
    args = parser.parse_args(argv)
    if args.port and not _free(args.port):
        # a newcomer's first command: one line that says what to do, not uvicorn's traceback
        print(
            f"tokenprobe demo: port {args.port} is in use; pass --port N (0: any free port)",
            file=sys.stderr,
        )
        return 2
    try:
        return asyncio.run(run(args.port, args.rounds, args.serve))
    except KeyboardInterrupt:
        return 0


def _free(port: int) -> bool:
    """Whether the proxy can listen on 127.0.0.1:`port` (as uvicorn binds: SO_REUSEADDR)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
