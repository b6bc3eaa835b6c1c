"""The in-process benchmarks measure what they say they measure.

`benchmarks/perrequest.py` runs one request's whole measuring with the sinks `serve`
builds (each timed whole request must be recorded, its tokens taken from its usage); `benchmarks/peers/emitter.py`'s chunks
differ only in their text, as vLLM's do, so the observer's template match applies to
them as it does to vLLM's. `benchmarks/wirerequest.py` times requests that went through
the wire and that the proxy counted as what they were (measured, or relayed unmeasured).
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from proxy.core.observe import StreamObserver
from proxy.core.request import parse_request
from tests.paths import ROOT

BENCHMARKS = ROOT / "benchmarks"


def test_perrequest_times_each_part_of_a_measured_request() -> None:
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "perrequest.py"), "--chunks", "8", "--requests", "50"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    # The access log went to /dev/null while timed: stdout is the report alone.
    assert '"endpoint"' not in run.stdout, run.stdout[:500]
    figures = dict(re.findall(r"^  (\w[\w ()+,;]*?)\s{2,}([\d.]+) µs", run.stdout, re.M))
    assert len(figures) == 4, run.stdout
    begin, streamed, finish, whole = (float(v) for v in figures.values())
    assert 0 < begin < whole and 0 < streamed < whole and 0 < finish < whole, figures
    # What it timed was a measured request, recorded in full: 5 repeats of 50, each a
    # stream of 8 content events whose usage says 8 output tokens.
    assert "recorded: 250 requests (finish stop), 2000 output tokens (usage)" in run.stdout


@pytest.mark.parametrize(
    ("path", "counted"),
    [
        ("/v1/chat/completions", "60 requests, 0 passthrough_requests"),
        ("/bench/unmeasured", "0 requests, 60 passthrough_requests"),
    ],
)
def test_wirerequest_times_requests_the_wire_relayed_and_counted(path: str, counted: str) -> None:
    sizes = ["--rounds", "1", "--requests", "20", "--repeats", "2"]
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "wirerequest.py"), "--path", path, *sizes],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    figure = re.search(r"^\s+([\d.]+)\s+/", run.stdout, re.M)
    assert figure is not None and float(figure.group(1)) > 0, run.stdout
    # Every request went through the wire to the backend and back, and the proxy's
    # metrics say what it was: measured, or relayed unmeasured (warm-up included).
    assert f"counted: {counted}" in run.stdout, run.stdout


def test_the_emitters_chunks_differ_only_in_their_text() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from peers import emitter
    finally:
        sys.path.remove(str(BENCHMARKS))
    one, two, three = (emitter.CHUNK % (7, 1796224770071549000 + i * 20**6) for i in range(3))
    text = re.compile(rb'"content":"@\d+"')
    assert text.sub(b"", one) == text.sub(b"", two) and one != two
    # The observer learns its template from the first and recognises the second by it,
    # with no JSON parse (proxy/core/template.py).
    info, _ = parse_request("/v1/chat/completions", b'{"model":"m","stream":true}')
    observer = StreamObserver(info, 0.0)
    observer.open(200, "text/event-stream", 0.0)
    observer.feed(one, 1.0)  # the stream's id is taken from the first
    observer.feed(two, 2.0)  # the first plain content event: learnt
    template = observer._template
    assert template is not None
    assert template.fits(three.removeprefix(b"data: ").removesuffix(b"\n\n"))


@pytest.mark.parametrize(("stamp", "fits"), [("text", True), ("key", False)])
def test_the_benchmark_simulators_chunks_fit_one_template_when_stamped_in_their_text(
    stamp: str, fits: bool
) -> None:
    """`benchmarks/peers/sim_server.py` stamps inside the text (`stamp_in_text`): its chunks
    then take the observer's template path, as vLLM's do; a `sent_ns` key before the text
    (`x-sim-stamp: 1`) gives every chunk a head of its own, and each is parsed in full."""
    from proxy.sim.wire import StreamWire

    sys.path.insert(0, str(BENCHMARKS))
    try:
        from peers import sim_server
    finally:
        sys.path.remove(str(BENCHMARKS))
    assert sim_server.Dispatch().free.config.stamp_in_text
    wire = StreamWire(True, "chatcmpl-7f3a", 1796224770, "sim-model", stamp)
    one, two, three = (wire.content(b" tok%d" % i) for i in range(3))
    info, _ = parse_request("/v1/chat/completions", b'{"model":"m","stream":true}')
    observer = StreamObserver(info, 0.0)
    observer.open(200, "text/event-stream", 0.0)
    observer.feed(wire.role(), 0.5)
    observer.feed(one, 1.0)
    observer.feed(two, 2.0)
    template = observer._template
    assert (template is not None and template.fits(three[len(b"data: ") : -2])) is fits
