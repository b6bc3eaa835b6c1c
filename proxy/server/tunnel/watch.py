"""The WebSocket watch: frames read beside a pipe's bytes, never in their way.

Once the upstream switched protocols, every read (after it went on to the other side)
feeds its direction's `FrameBounds`, which notes where frames end and which side sent a
close frame first; on a path with a WebSocket API (proxy/core/wsseam.py) the direction's
`FrameReader` also hands its messages to that API's session. Measuring fails in one
place, `_watch`: the session is no longer watched, a counter says so
(`tokenprobe_measurement_failures_total{stage="ws_frames"|"observe"|"finish"}`), and the
bytes go on.

The drain (`drain`, on SIGTERM) writes each side a close frame (1001, going away) once the
frames towards it are at a boundary, never inside a frame; nothing read afterwards goes
to a side that has it (the pipe seals it), and the session ends once both answered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from proxy.core.wsframes import (
    DeflateParams,
    FrameBounds,
    FrameError,
    FrameReader,
    close_frame,
    deflate_params,
)
from proxy.core.wsseam import CLOSE_CAUSES, WsSession
from proxy.server.tunnel.pipe import Pipe

log = logging.getLogger("tokenprobe")

GOING_AWAY = 1001
SHUTDOWN_REASON = "proxy shutting down"
#: A read of more than TINY_FRAMES frames averaging under TINY_FRAME_BYTES each (a flood of
#: pings, each 2 to 6 bytes of header and little else) stops the watching: the frame
#: reader's Python costs some 7 µs a frame, and such a read would hold the event loop for
#: every stream (256 KiB of 6-byte pings: 0.2 s). Frames the APIs measure are larger: a
#: vLLM transcription.delta is some 45 bytes (`{"type":"transcription.delta","delta":"
#: word"}` and its 2-byte header), and hundreds of them come in one read after a stall
#: of the proxy, which must not cost their utterance its record. (Compressed by
#: permessage-deflate a delta is some 7 bytes: such a read of them still stops it.)
TINY_FRAMES = 256
TINY_FRAME_BYTES = 16


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
        self.draining = False
        self._session: WsSession | None = None
        self._readers: tuple[FrameReader, FrameReader] | None = None  # (client, upstream)

    def start(self, after: bytes) -> None:
        """The upstream switched: `after` is what followed its 101 head in the same read
        (its first frames, a close among them as likely as any: it closed first then)."""
        self.upstream_bounds.feed(after)
        if self.upstream_bounds.closed and self.first_close is None:
            self.first_close = False

    def follow(
        self,
        extensions: str | None,
        max_message_bytes: int,
        open_session: Callable[[], WsSession],
        after: bytes,
        now: float,
    ) -> None:
        """On a path with a WebSocket API: its session, and a frame reader each way
        (permessage-deflate as the 101's `extensions` agreed)."""
        try:
            deflate: DeflateParams | None = deflate_params(extensions)
            limit = max_message_bytes
            self._readers = (FrameReader(True, deflate, limit), FrameReader(False, deflate, limit))
            self._session = open_session()
        except FrameError:
            self._stop_watching("ws_frames")
            return
        except Exception:
            log.exception("opening a WebSocket session's measurement failed")
            self._stop_watching("observe")
            return
        self._watch(False, after, now)

    def seen(self, from_client: bool, data: bytes, at: float) -> None:
        """A read from one side at `at` (perf_counter, the read's instant)."""
        if self.draining and (not from_client) in self.pipe.sealed:
            # The other side has our close frame: nothing went to it. Only this side's
            # answer to its own close frame is looked for.
            (self.client_bounds if from_client else self.upstream_bounds).feed(data)
            self._drain_step()
            return
        bounds = self.client_bounds if from_client else self.upstream_bounds
        frames = bounds.frames
        bounds.feed(data)
        if bounds.closed and self.first_close is None:
            self.first_close = from_client
        if self._readers is not None:
            frames = bounds.frames - frames
            if frames > TINY_FRAMES and len(data) < frames * TINY_FRAME_BYTES:
                log.warning("stopped watching a WebSocket session: %d frames in one read", frames)
                self._stop_watching("ws_frames")
            else:
                self._watch(from_client, data, at)
        if self.draining:
            self._drain_step()

    def _watch(self, from_client: bool, data: bytes, now: float) -> None:
        """The one place measuring a session can fail; it never stops the bytes."""
        readers, session = self._readers, self._session
        if readers is None or session is None or not data:
            return
        try:
            for message in readers[0 if from_client else 1].feed(data, now):
                session.message(message)
        except FrameError as exc:
            log.warning("stopped watching a WebSocket session: %s", exc)
            self._stop_watching("ws_frames")
        except Exception:
            log.exception("measuring a WebSocket session failed")
            self._stop_watching("observe")

    def _stop_watching(self, stage: str) -> None:
        self._readers = None
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
        session, self._session, self._readers = self._session, None, None
        if session is None:
            return
        try:
            session.close(now, outcome if outcome in CLOSE_CAUSES else "error")
        except Exception:
            log.exception("finishing a WebSocket session's measurement failed")
            self.failed("finish")
