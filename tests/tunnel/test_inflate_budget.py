"""The watch's inflating budget (proxy/server/tunnel/budget.py, `inflate_budget`), with the
time passed in: a realtime client's audio, even sent 100 times faster than real time, never
runs it out, and a deflate bomb does within a bounded number of bytes."""

from __future__ import annotations

from proxy.server.tunnel.budget import INFLATE_HELD, INFLATE_PER_SECOND, inflate_budget

MiB = 1024 * 1024
#: base64 PCM16 at 24 kHz mono: 48,000 bytes of audio a second, 64,000 once encoded.
AUDIO_PER_SECOND = 64_000


def test_two_messages_as_large_as_vllm_takes_fit_at_the_start() -> None:
    """uvicorn's ws_max_size (16 MiB, config.py), vLLM's server's bound on a message."""
    budget = inflate_budget(0.0)
    assert budget.most(0.0) >= 2 * 16 * MiB


def test_an_hour_of_audio_sent_100_times_faster_than_real_time_never_runs_it_out() -> None:
    budget, now = inflate_budget(0.0), 0.0
    append = AUDIO_PER_SECOND // 10  # an append of 0.1 s of audio...
    for _ in range(36_000):  # ...an hour of them, one every ms
        now += 0.001
        assert budget.most(now) >= append
        budget.take(append)


def test_a_bomb_runs_it_out_after_what_it_holds_and_what_the_time_earned() -> None:
    budget, now, inflated = inflate_budget(0.0), 0.0, 0
    while (most := budget.most(now)) >= 4_000_000:  # 4 MB messages, one every ms
        budget.take(4_000_000)
        inflated += 4_000_000
        now += 0.001
    assert inflated <= INFLATE_HELD + INFLATE_PER_SECOND * now
    assert now < 0.1 and most < 4_000_000
