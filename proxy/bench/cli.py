"""`tokenprobe bench`: flags in; progress on stderr, a table on stdout, JSON and a chart on request.

Exit status: 0 when requests succeeded, 1 when none did or the run stopped as failing (the
backend stopped answering mid-run; the first line on stderr says why), 2 for bad flags,
130 when interrupted (what was measured is still reported).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from proxy.bench import compare, prefill, report
from proxy.bench.client import Call, connector, prepare, uncounted_prompts
from proxy.bench.load import Level, Runner
from proxy.bench.loop import run_loop, tokenizer
from proxy.bench.options import Options, OptionsError, parse
from proxy.bench.progress import Progress
from proxy.bench.prompts import BUILTIN, PromptError, load_file, synthetic
from proxy.bench.stats import summarize
from proxy.core import extras
from proxy.core.buckets import TTFT_BUCKETS
from proxy.core.measurement import ErrorType
from proxy.openfiles import raise_open_file_limit

PROG = "tokenprobe bench"
#: Synthetic prompts made for --input-tokens: enough that no two nearby requests share one.
#: Synthetic prompts are one per request of the run (a prompt sent twice is served from
#: a prefix cache, vLLM's by default), at most this many when no --requests bounds the run:
#: past it they repeat.
SYNTHETIC_PROMPTS_UNBOUNDED = 4096


@dataclass(slots=True)
class Run:
    levels: list[Level]
    input_tokens: list[int | None]  # per level: the prompt length of an --input-tokens sweep
    stop_reason: str | None
    problem: str | None
    compare: dict[str, Any] | None
    compare_text: str | None


def main(argv: Sequence[str]) -> int:
    # One connection a request in flight: under a soft open-file limit of 128, 86 of 200
    # requests at concurrency 200 failed "Too many open files", reported as the backend
    # unreachable. Raised as `tokenprobe serve` raises it (and sglang's bench_serving).
    raise_open_file_limit()
    if argv and argv[0] == "compare":
        from proxy.bench.compare_runs import main as compare_main

        return compare_main(argv[1:])
    if argv and argv[0] == "merge":
        from proxy.bench.merge import main as merge_main

        return merge_main(argv[1:])
    if argv and argv[0] == "replay":
        from proxy.bench.replay import main as replay_main

        return replay_main(argv[1:])
    try:
        options = parse(argv)
        _check_outputs(options)
        if options.workers > 1:
            return _parent(options, argv)
        tokenizer = _tokenizer(options)
        sweep: list[tuple[int | None, list[Call]]] = [
            (n, [prepare(options, p) for p in _prompts(options, tokenizer, n)])
            for n in (options.input_tokens or (None,))
        ]
    except (OptionsError, PromptError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    try:
        run = _run_loop(_bench(options, sweep, tokenizer))
    except KeyboardInterrupt:  # before the run could install its own handler
        return 130
    if run.stop_reason == "interrupted":
        print(f"{PROG}: interrupted; reporting what was measured", file=sys.stderr)
    summaries = [summarize(level, options.slo) for level in run.levels]
    if any(s.ok for s in summaries):  # else the one-line problem below says it all
        print(
            report.table(
                summaries, options.cost_per_hour, options.currency, open_loop=options.mode == "open"
            )
        )
        if options.input_tokens:
            print(
                "\nTTFT by input length (--input-tokens)\n"
                + prefill.table(run.levels, run.input_tokens)
            )
    if run.compare_text:
        print("\nbench vs proxy (--compare-metrics)\n" + run.compare_text)
    if run.problem:
        print(f"{PROG}: error: {run.problem}", file=sys.stderr)
    _note_uncounted(options, run.levels)
    status = {"interrupted": "interrupted", "failing": "failing"}.get(
        run.stop_reason or "", "complete"
    )
    if options.out:
        doc = report.document(
            options,
            run.levels,
            summaries,
            status=status,
            problem=run.problem,
            compare=run.compare,
            prompts_sha256=_digest(sweep),
        )
        report.write_json(options.out, doc)
        print(f"{PROG}: wrote {options.out}", file=sys.stderr)
    if options.plot and summaries:
        from proxy.bench.plot import draw

        draw(options.plot, run.levels, summaries)
        print(f"{PROG}: wrote {options.plot}", file=sys.stderr)
    if status == "interrupted":
        return 130
    # "failing" after some successes: the backend stopped answering mid-run (load.py)
    return 0 if any(s.ok for s in summaries) and status != "failing" else 1


def _parent(options: Options, argv: Sequence[str]) -> int:
    """--workers N: N worker processes run the load on one clock; this one merges them,
    scrapes --compare-metrics around the whole run (a worker's scrape would set its share
    of the requests against all the proxy saw), and reports as one process does."""
    from proxy.bench.merge import levels_of
    from proxy.bench.workers import WorkerError, run

    try:
        before = None
        if options.compare_metrics:
            before = _run_loop(compare.scrape(options.compare_metrics))
        doc = run([], argv, options.workers)
    except (WorkerError, compare.ScrapeError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    levels = levels_of([doc])
    compare_text = None
    if options.compare_metrics and before is not None and doc["status"] != "interrupted":
        try:
            doc["compare"], compare_text = _run_loop(
                _compared(options.compare_metrics, options, before, levels)
            )
        except compare.ScrapeError as exc:
            doc["problem"] = doc.get("problem") or str(exc)
        except KeyboardInterrupt:  # the run is over: report it
            doc["status"] = "interrupted"
    if doc["status"] == "interrupted":
        print(f"{PROG}: interrupted; reporting what was measured", file=sys.stderr)
    summaries = [summarize(level, options.slo) for level in levels]
    if any(s.ok for s in summaries):
        print(
            report.table(
                summaries, options.cost_per_hour, options.currency, open_loop=options.mode == "open"
            )
        )
    if compare_text:
        print("\nbench vs proxy (--compare-metrics)\n" + compare_text)
    if doc.get("problem"):
        print(f"{PROG}: error: {doc['problem']}", file=sys.stderr)
    _note_uncounted(options, levels)
    if options.out:
        doc["config"]["workers"] = options.workers
        report.write_json(options.out, doc)
        print(f"{PROG}: wrote {options.out}", file=sys.stderr)
    if options.plot and summaries:
        from proxy.bench.plot import draw

        draw(options.plot, levels, summaries)
        print(f"{PROG}: wrote {options.plot}", file=sys.stderr)
    if doc["status"] == "interrupted":
        return 130
    return 0 if any(s.ok for s in summaries) and doc["status"] != "failing" else 1


def _check_outputs(options: Options) -> None:
    """Fail before the run, not after it, when its results could not be written."""
    for flag, path in (("--out", options.out), ("--plot", options.plot)):
        if path and not os.access(os.path.dirname(os.path.abspath(path)), os.W_OK):
            raise OptionsError(f"{flag}: cannot write to {os.path.dirname(os.path.abspath(path))}")
    if options.plot and extras.missing("matplotlib"):
        raise OptionsError(
            f"--plot {options.plot}: " + extras.needs("the chart", "matplotlib", "plot")
        )


def _note_uncounted(options: Options, levels: Sequence[Level]) -> None:
    """A note on stderr when the tokenizer left prompts uncounted (client.uncounted_prompts);
    a worker of --workers leaves it to the parent, which sees every record."""
    if options.tokenizer and not options.sync:
        note = uncounted_prompts((r for level in levels for r in level.results), options.tokenizer)
        if note:
            print(f"{PROG}: note: {note}", file=sys.stderr)


def _tokenizer(options: Options) -> Any:
    return tokenizer(options.tokenizer)


def _prompts(options: Options, tokenizer: Any, input_tokens: int | None) -> list[Any]:
    if input_tokens is not None:
        count = SYNTHETIC_PROMPTS_UNBOUNDED
        if options.requests is not None:
            count = options.requests * len(options.levels)
        return synthetic(tokenizer, input_tokens, count, options.endpoint, options.seed)
    if options.prompts_file:
        return load_file(options.prompts_file)
    return list(BUILTIN)


_run_loop = run_loop


def _digest(sweep: list[tuple[int | None, list[Call]]]) -> str:
    """Identifies the prompts sent, so that `bench compare` can tell runs with other prompts."""
    h = hashlib.sha256()
    for _, calls in sweep:
        for call in calls:
            h.update(orjson.dumps(call.info.prompt))
    return h.hexdigest()


async def _bench(
    options: Options, sweep: list[tuple[int | None, list[Call]]], tokenizer: Any
) -> Run:
    progress = Progress(options.requests, enabled=options.progress)
    runners = [Runner(options, calls, tokenizer, on_result=progress.result) for _, calls in sweep]
    runner = runners[0]
    levels: list[Level] = []
    lengths: list[int | None] = []

    def interrupt() -> None:
        for r in runners:
            r.interrupt()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, interrupt)
    problem = compare_doc = compare_text = None
    try:
        before = await compare.scrape(options.compare_metrics) if options.compare_metrics else None
        if options.sync or options.start_at is not None:
            from proxy.bench.workers import at_wall_clock, wait_for_start

            runners[0].start_at = (
                wait_for_start() if options.sync else at_wall_clock(options.start_at or 0.0)
            )
        progress.start()
        try:
            for runner, (n, _) in zip(runners, sweep, strict=True):
                await runner.run()
                for level in runner.levels:
                    if len(sweep) > 1:
                        level.label = f"in={n} {level.label}"
                    levels.append(level)
                    lengths.append(n)
                if runner.stop_reason:
                    break
        finally:
            progress.close()
        if runner.stop_reason == "failing" and runner.failure is not None:
            served = (
                await _served_models(options)
                if runner.failure.m.error_type is ErrorType.NOT_FOUND
                else []
            )
            problem = report.diagnose(runner.failure, options, served)
            if runner.dead_mid_run:  # not every request failed: it stopped answering
                problem = f"the backend stopped answering mid-run, stopped: {problem}"
        if options.compare_metrics and before is not None and runner.stop_reason != "interrupted":
            compare_doc, compare_text = await _compared(
                options.compare_metrics, options, before, levels
            )
    except compare.ScrapeError as exc:
        problem = str(exc)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    return Run(levels, lengths, runner.stop_reason, problem, compare_doc, compare_text)


async def _compared(
    url: str, options: Options, before: list[compare.Sample], levels: Sequence[Level]
) -> tuple[dict[str, Any], str]:
    """--compare-metrics: the bench's figures against the proxy's over the run, as JSON and
    as the side-by-side table."""
    results = [r for level in levels for r in level.results]
    after = await compare.settled(url, before, options.endpoint, options.model, len(results))
    bench = compare.bench_figures(results, TTFT_BUCKETS)
    proxy = compare.proxy_figures(before, after, options.endpoint, options.model)
    return compare.as_json(bench, proxy), compare.side_by_side(bench, proxy)


async def _served_models(options: Options) -> list[str]:
    """The backend's /v1/models, to suggest a name after an unknown-model failure."""
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    try:
        timeout = aiohttp.ClientTimeout(total=5)
        async with (
            aiohttp.ClientSession(timeout=timeout, connector=connector(options.uds)) as s,
            s.get(f"{options.base_url}/v1/models", headers=headers) as r,
        ):
            data = orjson.loads(await r.read())
        return [str(m["id"]) for m in data["data"]][:10]
    except Exception:  # a hint only
        return []
