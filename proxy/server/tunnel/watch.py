"""The WebSocket watch: frames read beside a pipe's bytes, never in their way.

Once the upstream switched protocols, every read (after it went on to the other side)
feeds its direction's `FrameBounds`, which notes where frames end and which side sent a
close frame first; on a path with a WebSocket API (proxy/core/wsseam.py) the direction's
`FrameReader` also hands its messages to that API's session. Measuring fails in one
place, `_read`: the session is no longer watched, a counter says so
(`tokenprobe_measurement_failures_total{stage="ws_frames"|"observe"|"finish"}`), and the
bytes go on. A data message over the reader's bound (`--max-event-bytes`) is relayed
unread and the session goes on being watched: each one is counted
(`stage="ws_message_too_large"`) and said in the log; so is a message that would take
what the readers of every tunnel of the worker hold of half-received messages past
their shared bound (context.py `HELD_MESSAGE_BYTES`: `stage="ws_memory_bound"`, said once
a tunnel). A read carrying more frames than
its direction has earned (budget.py: a flood, never a real peer) stops the watching the
same way, before any is read; so does
a read carrying more frame headers than its direction may scan (budget.py,
`scan_budget`), and its direction's frames are no longer followed at all (no close frame
seen, none put between its frames at the drain), for the scan would cost every frame of
every read. So does a read whose messages would inflate past what its direction may
inflate (budget.py, `inflate_budget`): the reader stops before inflating further.

After the upstream's close frame the session is over (RFC 6455 §1.4, §5.5.1: the
upstream takes no data after it): the client's reads from then on are not read, so a
client's events held until the 101 and released after a 101 that came with a close
open no utterance the upstream never took.

The drain (`drain`, on SIGTERM) writes each side a close frame (1001, going away) once the
frames towards it are at a boundary, never inside a frame; nothing read afterwards goes
to a side that has it (the pipe seals it), and the session ends once both answered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from proxy.core.wsframes import (
    TOO_LARGE,
    UNHELD,
    DeflateParams,
    FrameBounds,
    FrameError,
    FrameReader,
    HeldBytes,
    InflateBudgetSpent,
    WsMessage,
    close_frame,
    deflate_params,
)
from proxy.core.wsseam import CLOSE_CAUSES, WsSession
from proxy.server.tunnel.budget import (
    INFLATE_HELD,
    INFLATE_PER_SECOND,
    FrameBudget,
    inflate_budget,
    scan_budget,
)
from proxy.server.tunnel.pipe import Pipe

log = logging.getLogger("tokenprobe")

GOING_AWAY = 1001
SHUTDOWN_REASON = "proxy shutting down"


class WsWatch:
    """The frames of one tunnel both ways, and its API's session when it has one."""

    def __init__(
        self, pipe: Pipe, failed: Callable[[str], None], drained: Callable[[], None]
    ) -> None:
        """`failed(stage)` counts a measuring failure; `drained()` ends the session once
        both sides answered the drain's close frames."""
        self.pipe = pipe
        self.failed = failed
        self.drained = drained
        self.client_bounds = FrameBounds()
        self.upstream_bounds = FrameBounds()
        self.first_close: bool | None = None  # True: the client sent the first close frame
        self.upstream_closed = False  # the upstream's close frame went by: the session is over
        self.draining = False
        self._session: WsSession | None = None
        self._readers: tuple[FrameReader, FrameReader] | None = None  # (upstream, client)
        # (upstream, client): the frames each direction may have read; anew in `follow`
        self._budgets = (FrameBudget(0.0), FrameBudget(0.0))
        # (upstream, client): the frame headers each direction may scan, full at the start
        self._scans = (scan_budget(0.0), scan_budget(0.0))
        # (upstream, client): the bytes each direction may inflate; anew in `follow`, and
        # only when permessage-deflate was agreed
        self._inflates: tuple[FrameBudget, FrameBudget] | None = None
        self._stopped = False  # the watching stopped, counted
        self._bound = 0  # the largest message read (`follow`'s max_message_bytes)
        self._unheld_said = False  # a message skipped for the shared bound, logged once

    def start(self, after: bytes, now: float) -> None:
        """The upstream switched: `after` is what followed its 101 head in the same read
        (its first frames, a close among them as likely as any: it closed first then)."""
        self._scan(False, self.upstream_bounds, after, now)
        if self.upstream_bounds.closed:
            self.upstream_closed = True
            if self.first_close is None:
                self.first_close = False

    def follow(
        self,
        extensions: str | None,
        max_message_bytes: int,
        open_session: Callable[[], WsSession],
        after: bytes,
        now: float,
        held: HeldBytes | None = None,
    ) -> None:
        """On a path with a WebSocket API: its session, and a frame reader each way
        (permessage-deflate as the 101's `extensions` agreed), counting what they hold of
        half-received messages in `held`, the worker's (context.py)."""
        if self._stopped:
            return  # the 101's own read ran out the scan: said and counted
        try:
            deflate: DeflateParams | None = deflate_params(extensions)
            limit = self._bound = max_message_bytes
            self._readers = (
                FrameReader(False, deflate, limit, held),
                FrameReader(True, deflate, limit, held),
            )
            self._session = open_session()
        except FrameError:
            self._stop_watching("ws_frames")
            return
        except Exception:
            log.exception("opening a WebSocket session's measurement failed")
            self._stop_watching("observe")
            return
        self._budgets = (FrameBudget(now), FrameBudget(now))
        if deflate is not None:
            self._inflates = (inflate_budget(now), inflate_budget(now))
        frames = self.upstream_bounds.frames  # all of them in `after`
        if not self._budgets[False].spend(frames, now):
            self._over_budget(False, frames)
        elif after:
            self._read(False, after, now)

    def seen(self, from_client: bool, data: bytes, at: float) -> None:
        """A read from one side at `at` (perf_counter, the read's instant)."""
        if self.draining and (not from_client) in self.pipe.sealed:
            # The other side has our close frame: nothing went to it. Only this side's
            # answer to its own close frame is looked for.
            bounds = self.client_bounds if from_client else self.upstream_bounds
            self._scan(from_client, bounds, data, at)
            self._drain_step()
            return
        bounds = self.client_bounds if from_client else self.upstream_bounds
        frames = bounds.frames
        whole = self._scan(from_client, bounds, data, at)
        if bounds.closed:
            if self.first_close is None:
                self.first_close = from_client
            if not from_client:
                self.upstream_closed = True
        # After the upstream's close nothing the client sends is the session's (its held
        # events released after a 101 that came with a close among them).
        if whole and self._readers is not None and not (from_client and self.upstream_closed):
            frames = bounds.frames - frames
            # One frame a read costs about what the read costs the pipe: no budget asked.
            if frames < 2 or self._budgets[from_client].spend(frames, at):
                self._read(from_client, data, at)
            else:
                self._over_budget(from_client, frames)
        if self.draining:
            self._drain_step()

    def _scan(self, from_client: bool, bounds: FrameBounds, data: bytes, now: float) -> bool:
        """`bounds` follows `data` as far as the direction's scan budget goes: False when
        it ran out in this read (the direction's frames are then lost to the tunnel)."""
        budget = self._scans[from_client]
        before = bounds.frames
        # A read of one frame asks nothing, as for the reading: a real stream's usual read.
        whole = bounds.feed(data, max(1, budget.most(now)))
        if (scanned := bounds.frames - before) > 1:
            budget.take(scanned)
        if not whole:
            self._scan_ran_out(from_client, scanned)
        return whole

    def _scan_ran_out(self, from_client: bool, scanned: int) -> None:
        """A read of more frame headers than its direction may scan: the watching stops,
        said and counted once a tunnel, as a read over the reading budget's."""
        if self._stopped:
            return
        side = "client" if from_client else "upstream"
        log.warning(
            "stopped watching a WebSocket session: more than %d frames in one read from "
            "the %s, more than its scanning budget; its frames are no longer followed",
            scanned,
            side,
        )
        self._stop_watching("ws_frames")

    def _over_budget(self, from_client: bool, frames: int) -> None:
        """A read of more frames than its direction earned (budget.py): none is read."""
        side = "client" if from_client else "upstream"
        log.warning(
            "stopped watching a WebSocket session: %d frames in one read from the %s, "
            "more than its frame budget",
            frames,
            side,
        )
        self._stop_watching("ws_frames")

    def _over_inflate_budget(self, from_client: bool) -> None:
        """A read whose messages would inflate past what its direction earned (budget.py,
        `inflate_budget`): the reader stopped before inflating further."""
        side = "client" if from_client else "upstream"
        log.warning(
            "stopped watching a WebSocket session: the %s's compressed messages inflate "
            "faster than its inflating budget (%d MiB a second, at most %d at once)",
            side,
            INFLATE_PER_SECOND // (1024 * 1024),
            INFLATE_HELD // (1024 * 1024),
        )
        self._stop_watching("ws_frames")

    def _read(self, from_client: bool, data: bytes, now: float) -> None:
        """The one place measuring a session can fail; it never stops the bytes."""
        session, readers = self._session, self._readers
        assert session is not None and readers is not None  # set and cleared together
        reader = readers[from_client]
        try:
            if (inflates := self._inflates) is None:
                messages = reader.feed(data, now)
            else:
                budget = inflates[from_client]
                try:
                    messages = reader.feed(data, now, budget.most(now))
                finally:
                    budget.take(reader.inflated)
            for message in messages:
                if message.kind == TOO_LARGE:
                    self._too_large(message)
                elif message.kind == UNHELD:
                    self._unheld(message)
                session.message(message)
        except InflateBudgetSpent:
            self._over_inflate_budget(from_client)
        except FrameError as exc:
            log.warning("stopped watching a WebSocket session: %s", exc)
            self._stop_watching("ws_frames")
        except Exception:
            log.exception("measuring a WebSocket session failed")
            self._stop_watching("observe")

    def _too_large(self, message: WsMessage) -> None:
        """A message over the bound went by unread: its content is lost to measuring
        (a realtime append's audio: that utterance's audio seconds fall short), not the
        session's. The session sees it too, as a TOO_LARGE message."""
        side = "client" if message.from_client else "upstream"
        log.warning(
            "a WebSocket message from the %s over %d bytes (--max-event-bytes) was relayed "
            "unread; the session goes on being measured without it",
            side,
            self._bound,
        )
        self.failed("ws_message_too_large")

    def _unheld(self, message: WsMessage) -> None:
        """A message relayed unread because the frame readers of every tunnel held as much
        of half-received messages as the worker allows (context.py `HELD_MESSAGE_BYTES`):
        its content is lost to measuring, as an oversized one's is. Counted each time,
        said once a tunnel (a peer holding the bound full could send many)."""
        self.failed("ws_memory_bound")
        if self._unheld_said:
            return
        self._unheld_said = True
        log.warning(
            "a WebSocket message from the %s was relayed unread: the tunnels of this worker "
            "hold as much of messages still arriving as it allows; the session goes on "
            "being measured without it",
            "client" if message.from_client else "upstream",
        )

    def _drop_readers(self) -> None:
        """The readers go: what they held of half-received messages is given back."""
        readers, self._readers = self._readers, None
        if readers is not None:
            for reader in readers:
                reader.release()

    def _stop_watching(self, stage: str) -> None:
        self._stopped = True
        self._drop_readers()
        self._session = None
        self.failed(stage)

    # -- the drain ----------------------------------------------------------------------

    def drain(self) -> None:
        """Close frames (1001) both ways at frame boundaries, unless a close handshake is
        already under way (then it ends by itself)."""
        self.draining = True
        if self.first_close is None:
            self._drain_step()

    def _drain_step(self) -> None:
        """Write each side its close frame once the frames towards it are at a boundary;
        the session ends when both sides have answered with theirs."""
        sealed = self.pipe.sealed
        if self.first_close is not None and not sealed:
            return  # a close handshake was already under way: let it end by itself
        # A side whose own close frame went through already (a client that finished its
        # frame and answered ours in one read) has given the other side a close frame:
        # that side is sealed with no second one, and its bounds keep the close it saw.
        if True not in sealed and self.upstream_bounds.at_boundary:
            if self.upstream_bounds.closed:
                sealed.add(True)
            else:
                self.pipe.write_last(True, close_frame(GOING_AWAY, SHUTDOWN_REASON, masked=False))
                self.upstream_bounds = FrameBounds()  # now: the upstream's answer
        if False not in sealed and self.client_bounds.at_boundary:
            if self.client_bounds.closed:
                sealed.add(False)
            else:
                self.pipe.write_last(False, close_frame(GOING_AWAY, SHUTDOWN_REASON, masked=True))
                self.client_bounds = FrameBounds()  # now: the client's answer
        if len(sealed) == 2 and self.client_bounds.closed and self.upstream_bounds.closed:
            self.drained()

    # -- the end ------------------------------------------------------------------------

    def close(self, now: float, outcome: str) -> None:
        """The tunnel ended: the session records what is still open, once."""
        session, self._session = self._session, None
        self._drop_readers()
        if session is None:
            return
        try:
            session.close(now, outcome if outcome in CLOSE_CAUSES else "error")
        except Exception:
            log.exception("finishing a WebSocket session's measurement failed")
            self.failed("finish")
