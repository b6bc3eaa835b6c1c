"""The tunnel's byte pipe (proxy/server/tunnel/pipe.py) on fake transports: no socket, no
server, no WebSocket; a real event loop for its timers only. What it must do whatever the
protocol: hold the client until released, forward each read unchanged, pause one side
while the other's write buffer is full, seal a side that got its last bytes, pass a
half-close on, call an idle pipe idle, and cut a side that will not take its last bytes
within the grace."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from proxy.server.tunnel.pipe import HOLD_BYTES, Pipe


class FakeTransport:
    """What a pipe calls on an asyncio.Transport, recorded."""

    def __init__(self) -> None:
        self.written = bytearray()
        self.protocol: Any = None
        self.reading = True
        self.closing = False
        self.aborted = False
        self.buffered = 0  # what get_write_buffer_size says
        self.write_takes = 0.0  # seconds a write keeps the process (a preemption, say)
        self.written_at: list[float] = []  # perf_counter() as each write returned
        self.eof_writable = True  # what can_write_eof says (False: a TLS transport's)
        self.eof_written = False
        self.tls = False

    def set_protocol(self, protocol: Any) -> None:
        self.protocol = protocol

    def write(self, data: bytes) -> None:
        if self.eof_written:  # as asyncio's transports refuse it
            raise RuntimeError("Cannot call write() after write_eof()")
        self.written += data
        time.sleep(self.write_takes)
        self.written_at.append(time.perf_counter())

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.aborted = self.closing = True

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def can_write_eof(self) -> bool:
        return self.eof_writable

    def write_eof(self) -> None:
        assert self.eof_writable
        self.eof_written = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "sslcontext" and self.tls:
            return object()
        return default  # no socket: what it owes is its buffer (proxy/server/backlog.py)


class Ends:
    """The pipe's owner: what it heard."""

    def __init__(self) -> None:
        self.seen: list[tuple[bool, bytes]] = []
        self.seen_at: list[float] = []
        self.lost: list[bool] = []


def run(test: Callable[[], Any]) -> None:
    asyncio.run(test())


def pipe_between(grace: float = 0.05) -> tuple[Pipe, FakeTransport, FakeTransport, Ends]:
    client, upstream, ends = FakeTransport(), FakeTransport(), Ends()

    class Owner:
        def seen(self, from_client: bool, data: bytes, at: float) -> None:
            ends.seen.append((from_client, data))
            ends.seen_at.append(at)

        def lost(self, client_side: bool, exc: Exception | None) -> None:
            ends.lost.append(client_side)

    pipe = Pipe(client, Owner(), grace)  # type: ignore[arg-type]  # a fake transport
    side = pipe.upstream_protocol()
    side.connection_made(upstream)  # type: ignore[arg-type]
    upstream.set_protocol(side)  # as asyncio's connection does
    return pipe, client, upstream, ends


def test_the_client_is_held_until_released_then_its_bytes_go_in_order() -> None:
    async def test() -> None:
        pipe, client, upstream, ends = pipe_between()
        assert client.reading  # read on while held, so a client that leaves is seen
        pipe.hold(b"sent-with-the-head|")
        client.protocol.data_received(b"read-while-held|")
        pipe.from_upstream(b"HTTP/1.1 101 ...")
        assert bytes(client.written) == b"HTTP/1.1 101 ..." and pipe.relayed
        assert bytes(upstream.written) == b""
        big = b"x" * HOLD_BYTES  # past what is held with the client read on
        client.protocol.data_received(big)
        assert not client.reading
        pipe.release()
        assert bytes(upstream.written) == b"sent-with-the-head|read-while-held|" + big
        assert client.reading
        client.protocol.data_received(b"later")
        assert bytes(upstream.written).endswith(big + b"later")
        assert ends.seen == [
            (False, b"HTTP/1.1 101 ..."),
            (True, b"sent-with-the-head|read-while-held|" + big),
            (True, b"later"),
        ]

    run(test)


def test_a_read_is_timed_when_it_came_not_after_it_went_on() -> None:
    # A write that keeps the process 50 ms (the kernel ran something else): the instant
    # the owner times a message by is still the read's, so a backend answering within
    # those 50 ms cannot seem to answer before it was asked.
    async def test() -> None:
        pipe, client, upstream, ends = pipe_between()
        pipe.release()
        upstream.write_takes = client.write_takes = 0.05
        for side, data in ((client, b"commit"), (upstream, b"delta")):
            before = time.perf_counter()
            side.protocol.data_received(data)
            written_to = upstream if side is client else client
            # timed after this read came and before the 50 ms write began
            assert before <= ends.seen_at[-1] <= written_to.written_at[-1] - 0.05

    run(test)


def test_a_full_side_pauses_reading_from_the_other_until_it_drains() -> None:
    async def test() -> None:
        pipe, client, upstream, _ = pipe_between()
        pipe.release()
        client.protocol.pause_writing()  # the client's buffer is full
        assert not upstream.reading and client.reading
        pipe.writes_full(False, True)  # the upstream's too
        assert not client.reading
        client.protocol.resume_writing()
        assert upstream.reading and not client.reading  # the upstream's is still full
        pipe.writes_full(False, False)
        assert client.reading

    run(test)


def test_a_held_client_stays_paused_when_the_upstream_drains() -> None:
    async def test() -> None:
        pipe, client, _, _ = pipe_between()
        pipe.writes_full(False, True)
        pipe.writes_full(False, False)
        assert not client.reading  # still waiting for release

    run(test)


def test_a_sealed_side_gets_nothing_after_its_last_bytes() -> None:
    async def test() -> None:
        pipe, client, upstream, ends = pipe_between()
        pipe.release()
        pipe.write_last(True, b"<last>")
        pipe.from_upstream(b"more")
        client.protocol.data_received(b"answer")
        assert bytes(client.written) == b"<last>"
        assert bytes(upstream.written) == b"answer"  # the other way still flows
        assert ends.seen == [(False, b"more"), (True, b"answer")]  # the owner hears both

    run(test)


def test_a_quiet_pipe_is_idle_a_slow_reader_is_not_and_a_stuck_one_is() -> None:
    """A side taking its bytes slowly is progress; one whose buffer stays as it was takes
    nothing (a peer gone while its reading was paused), and the pipe idles out."""

    async def test() -> None:
        pipe, client, _, _ = pipe_between()
        quiet: list[float] = []
        client.buffered = 100
        pipe.start_idle(0.25, quiet.append)
        # The client takes some bytes every 20 ms for 0.4 s or more: past the timeout, so
        # a pipe blind to that progress idles out during it. The pipe looks every 0.25 s
        # at most, so it idles out at most 0.5 s after the progress stops.
        for _ in range(20):
            await asyncio.sleep(0.02)
            client.buffered -= 1
        assert quiet == []
        await asyncio.sleep(0.8)  # and then none
        assert len(quiet) == 1 and quiet[0] >= 0.25

    run(test)


def test_a_pipe_with_nothing_buffered_is_idle_after_the_timeout() -> None:
    async def test() -> None:
        pipe, _, _, _ = pipe_between()
        quiet: list[float] = []
        pipe.start_idle(0.05, quiet.append)
        await asyncio.sleep(0.2)
        assert len(quiet) == 1 and quiet[0] >= 0.05

    run(test)


def test_close_closes_both_and_cuts_a_side_that_keeps_its_bytes_after_the_grace() -> None:
    async def test() -> None:
        pipe, client, upstream, ends = pipe_between(grace=0.05)
        upstream.buffered = 10
        pipe.close()
        assert client.closing and upstream.closing and pipe.closed
        await asyncio.sleep(0.15)
        assert upstream.aborted and not client.aborted
        client.protocol.connection_lost(None)
        assert ends.lost == [True]

    run(test)


def test_a_fin_goes_on_to_the_other_side_which_may_still_answer() -> None:
    """A client that sends its last bytes (a close frame) and its FIN: the upstream gets
    both, and its answer still reaches the client; the upstream's own FIN then ends it."""

    async def test() -> None:
        pipe, client, upstream, ends = pipe_between()
        pipe.release()
        client.protocol.data_received(b"<close>")
        assert client.protocol.eof_received() is True  # kept open for the answer
        assert upstream.eof_written and not upstream.closing
        upstream.protocol.data_received(b"<its close>")
        assert bytes(client.written) == b"<its close>" and not client.eof_written
        assert upstream.protocol.eof_received() is False  # both ended: it closes
        assert ends.lost == []  # (its connection_lost tells the owner)

    run(test)


def test_the_upstreams_fin_goes_on_to_the_client_the_same() -> None:
    async def test() -> None:
        pipe, client, upstream, _ = pipe_between()
        pipe.release()
        assert upstream.protocol.eof_received() is True
        assert client.eof_written
        client.protocol.data_received(b"<answer>")
        assert bytes(upstream.written) == b"<answer>"
        assert client.protocol.eof_received() is False

    run(test)


def test_a_fin_before_the_release_closes_as_before() -> None:
    """Before the 101 a FIN is an end: a client gone before the answer, or an upstream's
    refusal whose body ran to the close."""

    async def test() -> None:
        _, client, upstream, _ = pipe_between()
        assert client.protocol.eof_received() is False
        assert upstream.protocol.eof_received() is False
        assert not client.eof_written and not upstream.eof_written

    run(test)


def test_a_tls_sides_fin_closes_it_as_before() -> None:
    """asyncio's SSL transport closes at the peer's FIN whatever the protocol says (and
    warns when told to stay open)."""

    async def test() -> None:
        pipe, client, upstream, _ = pipe_between()
        pipe.release()
        client.tls = True
        assert client.protocol.eof_received() is False
        assert not upstream.eof_written

    run(test)


def test_a_side_that_cannot_take_a_fin_gets_the_grace_then_the_pipe_ends() -> None:
    async def test() -> None:
        pipe, client, upstream, ends = pipe_between(grace=0.05)
        pipe.release()
        upstream.eof_writable = False  # a TLS upstream
        assert client.protocol.eof_received() is True
        upstream.protocol.data_received(b"<its close>")  # within the grace: it goes
        assert bytes(client.written) == b"<its close>" and ends.lost == []
        await asyncio.sleep(0.2)
        assert ends.lost == [True]  # the client's end, after the grace

    run(test)


def test_last_bytes_for_a_side_given_a_fin_are_not_written() -> None:
    """The drain's close frame for a side the other's FIN already went to: asyncio
    refuses a write after write_eof."""

    async def test() -> None:
        pipe, client, upstream, _ = pipe_between()
        pipe.release()
        client.protocol.eof_received()
        pipe.write_last(False, b"<going away>")
        assert bytes(upstream.written) == b"" and False in pipe.sealed

    run(test)
