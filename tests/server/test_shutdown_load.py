"""Graceful shutdown under load: SIGTERM with 100 streams in flight loses none of them.

A `tokenprobe serve` process with `--drain-timeout 20` in front of a simulator process
that hashes every body it sends. While 100 streams of ~3 s each are in flight, the proxy
gets SIGTERM: it must stop accepting connections at once, relay every stream to its
end byte for byte, and exit 0 well inside the drain time.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from pathlib import Path

from tests.server.test_load import Result, session, sim_headers, stack, stream_once

STREAMS = 100
DRAIN_TIMEOUT = 20.0
#: ~3 s per stream: 0.2 s to the first token, then 28 tokens at 10 tokens/s.
LONG_STREAM = sim_headers(0.2, 10, 28)


async def refused(port: int) -> bool:
    """Whether a new TCP connection to the proxy is refused."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 2)
    except ConnectionRefusedError:
        return True
    writer.close()
    return False


def exit_time(process: subprocess.Popen[bytes]) -> float:
    process.wait(DRAIN_TIMEOUT + 10)
    return time.monotonic()


def test_sigterm_with_100_streams_in_flight_drains_them_all_intact(tmp_path: Path) -> None:
    with stack(tmp_path, "--drain-timeout", str(DRAIN_TIMEOUT)) as s:
        port = int(s.url.rsplit(":", 1)[1])

        async def main() -> tuple[list[Result], float, bool, int]:
            async with session(STREAMS) as client:
                streams = [
                    asyncio.create_task(stream_once(client, s.url, LONG_STREAM))
                    for _ in range(STREAMS)
                ]
                deadline = time.monotonic() + 10
                while await asyncio.to_thread(s.sim_active) < STREAMS:
                    assert time.monotonic() < deadline, "the streams did not all start"
                    await asyncio.sleep(0.05)

                s.proxy.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                exited = asyncio.create_task(asyncio.to_thread(exit_time, s.proxy))
                # "At once" is within 2 s on a loaded machine: the streams have about 3 s
                # to run, so the count in flight after the refusal shows it came mid-drain.
                until = signalled + 2
                while not (refused_during_drain := await refused(port)):
                    if time.monotonic() > until:
                        break
                    await asyncio.sleep(0.05)
                in_flight = sum(not task.done() for task in streams)  # so the check was mid-drain
                results = await asyncio.gather(*streams)
                print(f"\nlast stream ended {time.monotonic() - signalled:.2f} s after SIGTERM")
                return results, await exited - signalled, refused_during_drain, in_flight

        results, drain, refused_during_drain, in_flight = asyncio.run(main())
        digests = s.sim_digests()  # the simulator outlives the proxy
        print(f"proxy exited {drain:.2f} s after SIGTERM ({in_flight} in flight when refused)")

        assert refused_during_drain and in_flight > 0, in_flight
        assert [r.error for r in results if r.error] == [], s.log_tail()
        assert [r.status for r in results] == [200] * STREAMS
        assert len(digests) == STREAMS  # every stream completed at the backend, none aborted
        intact = [r for r in results if r.response_id and digests.get(r.response_id) == r.sha256]
        assert len(intact) == STREAMS
        assert s.proxy.returncode == 0, s.log_tail()
        assert drain < DRAIN_TIMEOUT
