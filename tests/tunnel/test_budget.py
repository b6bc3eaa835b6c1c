"""The watch's frame budget (proxy/server/tunnel/budget.py), with the time passed in: what
a direction earns, the most one read may carry, and a real stream of vLLM deltas that
piles up behind a stalled proxy never refused."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from proxy.server.tunnel.budget import (
    AT_START,
    HELD,
    PER_SECOND,
    SCAN_HELD,
    SCAN_PER_SECOND,
    FrameBudget,
    scan_budget,
)


def test_a_fresh_direction_holds_its_start_and_no_more() -> None:
    assert FrameBudget(0.0).spend(int(AT_START), 0.0)
    assert not FrameBudget(0.0).spend(int(AT_START) + 1, 0.0)


def test_a_direction_earns_with_time_up_to_what_it_may_hold() -> None:
    budget = FrameBudget(0.0)
    assert budget.spend(int(AT_START), 0.0)
    assert budget.spend(int(PER_SECOND * 0.1), 0.1)  # 0.1 s later: 0.1 s of frames
    assert not budget.spend(2, 0.1)
    long_after = 3600.0
    assert not budget.spend(int(HELD) + 1, long_after)  # an hour idle: no more than HELD
    assert budget.spend(int(HELD), long_after)


def test_the_scan_starts_full_and_earns_up_to_what_it_may_hold() -> None:
    """The scan's count is known only once read: `most` says how many a read may carry,
    `take` spends what the read did carry."""
    budget = scan_budget(0.0)
    assert budget.most(0.0) == int(SCAN_HELD)
    budget.take(int(SCAN_HELD))
    assert budget.most(0.0) == 0
    assert budget.most(0.01) == int(SCAN_PER_SECOND * 0.01)
    assert budget.most(3600.0) == int(SCAN_HELD)  # an hour idle: no more than it may hold


def test_a_refused_read_takes_nothing() -> None:
    budget = FrameBudget(0.0)
    assert not budget.spend(10_000, 0.0)
    assert budget.spend(int(AT_START), 0.0)


@given(st.lists(st.tuples(st.floats(0, 2), st.integers(0, 3000)), max_size=60))
def test_no_span_reads_more_than_it_earned(reads: list[tuple[float, int]]) -> None:
    """Whatever a peer sends, however it spreads its reads: what the watch reads up to a
    moment is at most what the start and the time since earned, and no read is over HELD."""
    budget, now, taken = FrameBudget(0.0), 0.0, 0
    for gap, frames in reads:
        now += gap
        if budget.spend(frames, now):
            taken += frames
            assert frames <= HELD
        assert taken <= AT_START + PER_SECOND * now + 1e-6


def test_real_deltas_behind_a_stalled_proxy_are_never_refused() -> None:
    """vLLM's deltas at up to 400 a second (faster than a real engine steps), one read
    each, then a stall of the proxy (a busy loop, backpressure) of up to HELD/rate
    seconds: all of them in one read after it. Each stall follows 2 s of one-frame reads,
    which ask nothing of the budget."""
    for rate in (12.5, 100.0, 200.0, 400.0):
        budget, now = FrameBudget(0.0), 0.0
        for stall in (0.05, 0.5, 1.0, HELD / rate):
            now += 2.0
            piled = int(rate * stall)
            now += stall
            assert budget.spend(piled, now), (rate, stall, piled)
