"""`tokenprobe bench replay LOG [LOG ...] --url URL`: a recorded workload, replayed on a candidate.

Each request of the access logs (or of a Mooncake trace, `--mooncake`) is sent at its
recorded offset (open loop, `--speed` scales time), to the same API with the same stream
flag, with a synthetic prompt of its recorded token count and the recorded sharing of
prefixes (synth.py), and `max_tokens` = its recorded output with `ignore_eos`.
Conversations stay conversations: a later turn's prompt repeats all of its earlier turn's
(`continues`), and it goes its recorded turn gap after the candidate answered that turn
(`follows`). The output is the bench's table, the recorded figures beside the replayed
ones, and with `--out` the run file `tokenprobe bench compare` reads.

Exit status, as `tokenprobe bench`'s (cli.py): 0 when requests succeeded, 1 when none did,
the run stopped as failing (the target stopped answering mid-run), or the target could not
size the prompts (its /tokenize unreachable or refusing), 2 for bad flags (a --tokenizer
that does not load included) or nothing to replay, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import orjson
import yarl

from proxy.bench import report
from proxy.bench.client import Call, headers, masked, session, uncounted_prompts
from proxy.bench.load import Level, Runner, Schedule
from proxy.bench.loop import run_loop as _run_loop
from proxy.bench.loop import tokenizer as load_tokenizer
from proxy.bench.options import (
    ENDPOINTS,
    Options,
    OptionsError,
    _base_url,
    _header,
    parse_shard,
    parse_slo,
    seconds,
)
from proxy.bench.progress import ReplayProgress
from proxy.bench.recorded import recorded_figures, side_by_side
from proxy.bench.stats import summarize
from proxy.bench.synth import Builder, SynthError, body_fields
from proxy.bench.trace import (
    BLOCK,
    TraceError,
    Want,
    read_logs,
    read_mooncake,
    to_mooncake,
    write_mooncake,
)
from proxy.bench.workers import at_wall_clock, wait_for_start
from proxy.core.apis import RequestInfo
from proxy.core.apis.chat import Chat
from proxy.core.apis.completions import Completions
from proxy.core.apis.responses import Responses
from proxy.core.errors import error_message

PROG = "tokenprobe bench replay"


@dataclass(frozen=True, slots=True)
class Shard:
    index: int  # 0-based
    count: int

    def take(self, number: int) -> bool:
        return number % self.count == self.index


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Replay the shape of recorded traffic (tokenprobe access logs, or a "
        "Mooncake trace) against a backend: the recorded arrival offsets, APIs, stream flags, "
        "prompt and output token counts and shared prefixes, with synthetic content.",
    )
    a = p.add_argument
    a("logs", nargs="*", metavar="LOG", help="tokenprobe access logs (JSON lines)")
    a("--url", help="the candidate's base URL, e.g. http://localhost:8000/v1")
    a("--mooncake", metavar="TRACE", help="replay a Mooncake trace instead of access logs")
    a("--export-mooncake", metavar="OUT", help="write the workload as a Mooncake trace")
    a("--block-size", type=int, default=BLOCK, help=f"Mooncake tokens per hash id ({BLOCK})")
    a("--speed", type=float, default=1.0, help="time runs X times faster (2: half the span)")
    a("--window", metavar="FROM,TO", help="only the requests FROM..TO seconds into the log")
    a("--max-requests", type=int, help="only the first N requests (after --window)")
    a("--model-map", action="append", default=[], metavar="A=B", help="send model B for A")
    a("--model", help="the model for a Mooncake trace (which names none), or for every request")
    a("--endpoint", choices=tuple(ENDPOINTS)[:4], default="chat", help="API for a Mooncake trace")
    a("--no-stream", action="store_true", help="a Mooncake trace's requests not streamed")
    a(
        "--tokenizer",
        help="local tokenizer directory to size prompts (default: the target's /tokenize)",
    )
    a("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    a("--api-key", help="bearer token (default: $OPENAI_API_KEY)")
    a("--header", action="append", default=[], metavar="'NAME: VALUE'", help="extra request header")
    a("--timeout", type=float, default=300.0, help="longest silence within a response (s)")
    a("--slo", default="", help="goodput targets in seconds, e.g. ttft=0.5,tpot=0.05")
    a("--seed", type=int, default=0, help="seed of the synthetic prompts")
    a("--shard", metavar="I/N", help="replay only share I of N (0-based) of the requests")
    a("--workers", type=int, default=1, help="replay on N processes, merged into one run")
    a(
        "--start-at",
        type=float,
        metavar="UNIX",
        help="start at this wall-clock time (shards on several machines)",
    )
    a("--sync", action="store_true", help=argparse.SUPPRESS)  # a worker of --workers
    a("--out", help="write every per-request record and the summary to this JSON file")
    a("--label", help="name of this run in 'tokenprobe bench compare'")
    a("--quiet", action="store_true", help="no progress line")
    return p


def main(argv: Sequence[str]) -> int:
    try:
        ns = parser().parse_args(list(argv))
        shard = _check(ns)
        wants, skipped = _workload(ns)
        # the flags it reads (--url, --slo, --header) fail here, as one line, not mid-run
        options = _options(ns, wants) if ns.url and wants else None
        # a bad --tokenizer is a bad flag: refused here, not as a traceback (or a worker's
        # failure) once the run began
        tokenizer = load_tokenizer(options.tokenizer) if options is not None else None
    except (OptionsError, TraceError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    if skipped.count:
        print(f"{PROG}: {skipped.describe()}", file=sys.stderr)
    if not wants:
        where = "the trace" if ns.mooncake else "the logs"
        print(
            f"{PROG}: error: nothing to replay: {where} hold no replayable request "
            "(chat, completions, Messages or Responses lines with an arrival and a prompt "
            "token count)" + (", or none falls in --window" if ns.window else ""),
            file=sys.stderr,
        )
        return 2
    if ns.export_mooncake:
        write_mooncake(ns.export_mooncake, to_mooncake(wants, ns.block_size))
        print(f"{PROG}: wrote {len(wants)} requests to {ns.export_mooncake}", file=sys.stderr)
        if not ns.url:
            return 0
    if ns.workers > 1:
        return _parent(ns, argv, wants)
    assert options is not None, "--url is given here: an export-only run returned above"
    try:
        return _run_loop(_replay(ns, options, wants, shard, tokenizer))
    except KeyboardInterrupt:
        return 130


def _parent(ns: argparse.Namespace, argv: Sequence[str], wants: list[Want]) -> int:
    """--workers N: the workers replay, this process merges and reports."""
    from proxy.bench.merge import levels_of
    from proxy.bench.workers import WorkerError, run

    if not ns.quiet:
        print(f"{PROG}: {len(wants)} requests on {ns.workers} workers", file=sys.stderr)
    try:
        doc = run(["replay"], argv, ns.workers)
    except WorkerError as exc:  # e.g. a worker could not reach the target: as bench's
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    levels = levels_of([doc])
    summaries = [summarize(level, dict(doc["config"].get("slo") or {})) for level in levels]
    if any(s.ok for s in summaries):
        print(report.table(summaries, open_loop=True))
        print("\nrecorded vs replayed\n" + side_by_side(wants, levels))
    _note_uncounted(ns, levels)
    if ns.out:
        doc["config"]["workers"] = ns.workers
        report.write_json(ns.out, doc)
        print(f"{PROG}: wrote {ns.out}", file=sys.stderr)
    if doc.get("status") == "interrupted":  # what the workers measured, as one process
        print(f"{PROG}: interrupted; reported what was measured", file=sys.stderr)
        return 130
    return 0 if any(s.ok for s in summaries) and doc.get("status") != "failing" else 1


def _note_uncounted(ns: argparse.Namespace, levels: Sequence[Level]) -> None:
    """As bench's: say why prompts counted by --tokenizer have no tokens (a worker of
    --workers leaves it to the parent)."""
    if ns.tokenizer and not ns.sync:
        note = uncounted_prompts((r for level in levels for r in level.results), ns.tokenizer)
        if note:
            print(f"{PROG}: note: {note}", file=sys.stderr)


def _check(ns: argparse.Namespace) -> Shard:
    if not ns.logs and not ns.mooncake:
        raise OptionsError("name the access logs to replay (or --mooncake TRACE)")
    if ns.logs and ns.mooncake:
        raise OptionsError("access logs and --mooncake exclude each other")
    if not ns.url and not ns.export_mooncake:
        raise OptionsError("--url is required (unless only --export-mooncake)")
    if ns.mooncake and not ns.model:
        raise OptionsError("--mooncake needs --model (a trace names no model)")
    if not (math.isfinite(ns.speed) and ns.speed > 0):
        raise OptionsError("--speed must be a finite positive number")
    seconds("--timeout", ns.timeout)
    if ns.workers < 1:
        raise OptionsError("--workers must be at least 1")
    if ns.workers > 1 and ns.shard:
        raise OptionsError("--workers and --shard exclude each other (each worker is a shard)")
    if ns.max_requests is not None and ns.max_requests < 1:
        raise OptionsError("--max-requests must be at least 1")
    if ns.block_size < 1:
        raise OptionsError("--block-size must be at least 1")
    for item in ns.model_map:
        if "=" not in item or not item.split("=", 1)[0]:
            raise OptionsError(f"--model-map: expected A=B, got {item!r}")
    return Shard(*parse_shard(ns.shard)) if ns.shard else Shard(0, 1)


def window(wants: list[Want], text: str | None, most: int | None) -> list[Want]:
    """The requests in FROM..TO seconds (offsets then counted from FROM), the first `most`."""
    if text:
        try:
            low, high = (float(x) for x in text.split(","))
        except ValueError:
            raise OptionsError(f"--window: expected FROM,TO in seconds, got {text!r}") from None
        if not 0 <= low < high:
            raise OptionsError(f"--window: expected 0 <= FROM < TO, got {text!r}")
        wants = [replace(w, offset=w.offset - low) for w in wants if low <= w.offset < high]
    return wants[:most] if most is not None else wants


def _workload(ns: argparse.Namespace) -> tuple[list[Want], Any]:
    if ns.mooncake:
        endpoint = ENDPOINTS[ns.endpoint]
        wants, skipped = read_mooncake(
            ns.mooncake, endpoint, ns.model, not ns.no_stream, ns.block_size
        )
    else:
        wants, skipped = read_logs(ns.logs)
    mapping = dict(item.split("=", 1) for item in ns.model_map)
    wants = [
        replace(w, model=ns.model if ns.model else mapping.get(w.model, w.model)) for w in wants
    ]
    return window(wants, ns.window, ns.max_requests), skipped


def _options(ns: argparse.Namespace, wants: Sequence[Want]) -> Options:
    endpoints = {w.endpoint for w in wants}
    models = sorted({w.model for w in wants})
    return Options(
        base_url=_base_url(ns.url),
        model=",".join(models),
        endpoint=endpoints.pop() if len(endpoints) == 1 else Chat.endpoint,
        api_key=ns.api_key or os.environ.get("OPENAI_API_KEY") or None,
        mode="replay",
        levels=(ns.speed,),
        max_concurrency=None,
        ramp_up=0.0,
        requests=len(wants),
        duration=None,
        max_tokens=0,  # per request: its recorded output
        ignore_eos=not ns.no_ignore_eos,
        prompts_file=None,
        input_tokens=None,
        tokenizer=ns.tokenizer,
        seed=ns.seed,
        slo=parse_slo(ns.slo),
        timeout=ns.timeout,
        headers=tuple(_header(h) for h in ns.header),
        out=ns.out,
        plot=None,
        compare_metrics=None,
        progress=not ns.quiet,
        label=ns.label,
    )


def conversation_shards(wants: Sequence[Want]) -> list[int]:
    """The number each request is sharded by: its own, or its conversation's first
    request's, so one conversation's turns all go to one shard (and one worker)."""
    first: dict[str, int] = {}
    return [
        first.setdefault(w.conversation, i) if w.conversation else i for i, w in enumerate(wants)
    ]


def continues(wants: Sequence[Want]) -> list[int | None]:
    """For each request, the position of the earlier request of its conversation that it
    continues (its turn 2 or later, as the access log recorded), else None."""
    latest: dict[str, int] = {}
    out: list[int | None] = []
    for position, w in enumerate(wants):
        earlier = latest.get(w.conversation) if w.conversation else None
        out.append(earlier if w.turn is not None and w.turn > 1 else None)
        if w.conversation:
            latest[w.conversation] = position
    return out


def follows(wants: Sequence[Want], speed: float) -> list[tuple[int, float] | None]:
    """Conversations kept as conversations: a recorded continuation (with its turn gap)
    goes its recorded gap (scaled by --speed) after the candidate's answer to the previous
    request of its conversation ended, not at its recorded offset, so a slower or faster
    candidate keeps each turn after the answer it continues, and the tool's or user's time
    between them. A continuation whose earlier turn is not replayed (--window, another
    shard) goes at its offset."""
    return [
        None if earlier is None or w.turn_gap is None else (earlier, w.turn_gap / speed)
        for w, earlier in zip(wants, continues(wants), strict=True)
    ]


def request(want: Want, content: Any, ignore_eos: bool) -> Call:
    body: dict[str, Any] = {"model": want.model, **body_fields(want.endpoint, content)}
    limit = "max_output_tokens" if want.endpoint == Responses.endpoint else "max_tokens"
    body[limit] = want.output_tokens
    body["temperature"] = 0
    if want.stream:
        body["stream"] = True
        if want.endpoint in (Chat.endpoint, Completions.endpoint):
            body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True
    info = RequestInfo(
        endpoint=want.endpoint,
        model=want.model,
        stream=want.stream,
        usage_requested=True,
        max_tokens=want.output_tokens,
        temperature=0.0,
        prompt=content,
    )
    return Call(info, orjson.dumps(body))


async def _counter(options: Options, tokenizer: Any, model: str, client: Any) -> Any:
    """How the prompts are sized: a local tokenizer, else the target's /tokenize."""
    if tokenizer is not None:
        from proxy.core.tokens import count_prompt

        async def local(endpoint: str, content: Any) -> int:
            return count_prompt(tokenizer, content) or 0

        return local
    # Without the URL's user info, as the load's own requests go (proxy/bench/wire.py
    # sends none): aiohttp refused user info beside --api-key's Authorization, with a
    # traceback, and the messages below would show its password.
    url = str(yarl.URL(options.base_url + "/tokenize").with_user(None))
    hdrs = {k: v for k, v in headers(options).items() if k != "Accept"}

    async def remote(endpoint: str, content: Any) -> int:
        key = "prompt" if isinstance(content, str) else "messages"
        try:
            async with client.post(url, json={"model": model, key: content}, headers=hdrs) as r:
                data = await r.read()
                if r.status != 200:
                    said = masked(error_message(data), hdrs, yarl.URL(url))
                    raise SynthError(
                        f"{url} answered HTTP {r.status} ({said}): the prompts are "
                        "sized with the target's /tokenize; pass --tokenizer DIR instead"
                    )
                return int(orjson.loads(data)["count"])
        except (aiohttp.ClientError, OSError) as exc:
            raise SynthError(f"cannot reach {url} to size the prompts: {exc}") from None

    return remote


async def _replay(
    ns: argparse.Namespace, options: Options, wants: list[Want], shard: Shard, tokenizer: Any
) -> int:
    async with session(options) as client:
        count = await _counter(options, tokenizer, wants[0].model, client)
        builder = Builder(count, ns.seed)
        try:
            await builder.calibrate(wants[0].endpoint)
            contents = await builder.prompts(wants, continues(wants))
        except SynthError as exc:  # the target's /tokenize: unreachable, or it refused
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return 1  # what bench exits when the backend is unreachable or refuses
    if builder.missed:
        print(
            f"{PROG}: warning: {len(builder.missed)} prompts missed their recorded length by "
            f"more than 3% (e.g. wanted {builder.missed[0][0]}, got {builder.missed[0][1]})",
            file=sys.stderr,
        )
    calls = [request(w, c, options.ignore_eos) for w, c in zip(wants, contents, strict=True)]
    digest = hashlib.sha256(b"".join(c.body for c in calls)).hexdigest()
    mine = [i for i, n in enumerate(conversation_shards(wants)) if shard.take(n)]
    progress = ReplayProgress(len(mine), enabled=options.progress)
    schedule = Schedule(
        offsets=[wants[i].offset / ns.speed for i in mine],
        indices=mine,
        on_send=progress.sent,
        after=follows([wants[i] for i in mine], ns.speed),
    )
    runner = Runner(
        options,
        [calls[i] for i in mine],
        tokenizer,  # counts the tokens of a target that sends no usage, as bench's does
        on_result=progress.result,
        schedule=schedule,
        start_at=wait_for_start()
        if ns.sync
        else at_wall_clock(ns.start_at)
        if ns.start_at is not None
        else None,
    )
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, runner.interrupt)
    progress.schedule = schedule.offsets
    progress.start()
    try:
        levels = await runner.run()
    finally:
        progress.close()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    for level in levels:
        level.label = "replay" if ns.speed == 1 else f"replay x{ns.speed:g}"
    summaries = [summarize(level, options.slo) for level in levels]
    if any(s.ok for s in summaries) and not ns.sync:
        print(report.table(summaries, open_loop=True))
        print("\nrecorded vs replayed\n" + side_by_side([wants[i] for i in mine], levels))
    status = "interrupted" if runner.stop_reason == "interrupted" else "complete"
    problem = None
    if runner.stop_reason == "failing" and runner.failure is not None:
        problem = report.diagnose(runner.failure, options)
        if runner.dead_mid_run:  # not every request failed: it stopped answering
            problem = f"the backend stopped answering mid-run, stopped: {problem}"
        status = "failing"
        print(f"{PROG}: error: {problem}", file=sys.stderr)
    _note_uncounted(ns, levels)
    if options.out:
        doc = report.document(
            options, levels, summaries, status=status, problem=problem, compare=None,
            prompts_sha256=digest,
        )  # fmt: skip
        doc["replay"] = {
            "sources": list(ns.logs) or [ns.mooncake],
            "requests": len(wants),
            "shard": None if shard.count == 1 else [shard.index, shard.count],
            "speed": ns.speed,
            "window": ns.window,
            "recorded": recorded_figures([wants[i] for i in mine]),
        }
        report.write_json(options.out, doc)
        print(f"{PROG}: wrote {options.out}", file=sys.stderr)
    if status == "interrupted":
        return 130
    return 0 if any(s.ok for s in summaries) and status != "failing" else 1
