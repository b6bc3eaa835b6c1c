"""How many frames the WebSocket watch may read one by one, and how many bytes it may
inflate: earned with time, per direction.

The frame reader and the API's session cost 5 to 10 µs of Python a frame, and a read
holds the event loop, every stream's, until the watch has read all of it: 256 KiB of
16-byte pings held it 0.2 s. The size of a frame says nothing of its sender's intent
(permessage-deflate makes vLLM's deltas some 7 bytes), but the rate does: a real peer
sends frames only as fast as it makes them. So each direction earns `PER_SECOND` frames
a second and keeps at most `HELD` (it starts with `AT_START`); a read is read frame by
frame when its direction holds as many frames as the read carries (`FrameBounds`
counts them from their headers, well under 1 µs a frame), and one that carries more
stops the watching (watch.py), counted (`ws_frames`), none of its frames read. A read
of one frame asks nothing: reading it costs about what the read itself costs the pipe,
and it is a real stream's usual read. So a read costs at most `HELD` frames of reading,
and reads of several frames at most `PER_SECOND` a second beyond that.

vLLM 0.32's realtime (vllm/entrypoints/speech_to_text/realtime/connection.py,
`_run_generation`) sends one `transcription.delta` per engine output of the utterance's
request, each output one engine step's tokens (`RequestOutputKind.DELTA`), merged into
one when the server falls behind (vllm/v1/engine/output_processor.py,
`RequestOutputCollector.put`): at most one an engine step, a few hundred a second for a
small model on a fast GPU (an estimate, not a figure from the source). In real time it
is far fewer: Voxtral Realtime runs one engine step per `1000 / frame_rate` ms of audio
(`VoxtralRealtimeBuffer`), Qwen3-ASR at most 64 tokens per 5 s segment
(`realtime_max_tokens`, `segment_duration_s`). A delta is 43 bytes uncompressed and its
text (`{"type":"transcription.delta","delta":""}`, 2 bytes of header); compressed as
vLLM's uvicorn agrees it (websockets, 12 window bits, context kept), 6 to 8 bytes, a
word not seen before a few more. Deltas pile up in one read only while the proxy does not
read (its loop stalled, or backpressure): a stall of T s at R deltas a second brings R*T
frames, and the direction earns as many while R is under PER_SECOND, up to HELD. The
watching stops only past HELD frames in one read: a stall of 5 s at 200 deltas a second.
The frame headers themselves are budgeted the same way, apart (`scan_budget`): finding
where frames end (wsframes.FrameBounds) runs over every read of every tunnel, watched or
not, at some 0.2 to 0.4 µs a header, and 256 KiB of 2-byte frames held the loop 28 to
40 ms a read. A direction whose read carries more headers than it earned
(`SCAN_PER_SECOND`, at most `SCAN_HELD`) is no longer followed: its bytes go on unread,
the watching stops, and it is counted as above (watch.py, `_scan_ran_out`).

Inflating (permessage-deflate, which vLLM's uvicorn agrees by default: uvicorn
config.py, `ws_per_message_deflate=True`) is budgeted apart, in bytes inflated
(`inflate_budget`): its cost follows what it makes, not what came or how many frames,
and 3.9 KB of deflated "a"s is a 4 MB message, 17 to 24 ms of the loop inflated and copied
(3 to 6 ms a MB), one frame a read, which the frame budget never sees. A direction earns
`INFLATE_PER_SECOND` and holds at most `INFLATE_HELD`, full at the start; the reader
inflates a read's messages only as far as the direction holds (wsframes.FrameReader,
`inflate_most`), and a read that would go past it stops the watching, counted
(`ws_frames`) and said, the bytes relayed as ever. A real peer is far under it: a
realtime client's audio is base64 PCM16, 64 KB a second at 24 kHz (48 KB of PCM), so
8 MiB a second is 130 times real time; a recorded file sent as fast as the socket takes
it spends what the direction holds first, and one over about 32 MiB of base64 once
inflated (some 17 minutes at 16 kHz, 8.7 at 24 kHz, sent at once) stops the watching:
that session is then not measured (a limit, counted and said); text events are far less; and one message as large as vLLM takes (uvicorn's `ws_max_size`,
16 MiB, config.py) fits twice in what a direction holds. A bomb stops after at most
`INFLATE_HELD` plus what the time earned: 32 MiB of "a"s from one read stopped after 90
ms of a core (measured on the reader alone); earning costs at most 3 to 5% of one (per
direction of a tunnel).
"""

from __future__ import annotations

#: Frames a direction earns a second: over any real peer's rate (see above).
PER_SECOND = 1000.0
#: The most a direction keeps, and so the most frames the watch reads from one read:
#: some 10 ms of the loop at 10 µs a frame.
HELD = 1024.0
#: What a direction holds when the tunnel opens: the upstream's first events (vLLM's
#: session.created), a client's frames sent before the 101 and released with it.
AT_START = 256.0

#: Frame headers a direction's scan earns a second: 16 times what the reading earns (a
#: header costs some 30 times less), some 0.4 to 0.8% of a core.
SCAN_PER_SECOND = 20000.0
#: The most headers one read's scan reads, and what a direction starts with: some 1 to
#: 2 ms of the loop (0.2 to 0.4 µs a header), four times the reading's `HELD`, so that a
#: read the reading may take is always scanned whole.
SCAN_HELD = 4096.0


#: Bytes a direction may inflate a second: 130 times a realtime session's audio.
INFLATE_PER_SECOND = 8.0 * 1024 * 1024
#: The most a direction holds, and what it starts with: two messages of uvicorn's
#: `ws_max_size`, some 100 to 200 ms of the loop at 3 to 6 ms a MB.
INFLATE_HELD = 32.0 * 1024 * 1024


class FrameBudget:
    """One direction's frames to read: `spend(frames, now)` takes them, or says no;
    `most(now)` and `take(frames)` for a count known only once read (the scan's)."""

    __slots__ = ("at", "held", "left", "per_second")

    def __init__(
        self,
        now: float,
        per_second: float = PER_SECOND,
        held: float = HELD,
        at_start: float = AT_START,
    ) -> None:
        self.per_second, self.held = per_second, held
        self.left = at_start
        self.at = now  # when it last earned

    def spend(self, frames: int, now: float) -> bool:
        """Take `frames`, read at `now` (perf_counter); False, taking nothing, when the
        direction has not earned that many."""
        left = self.left - frames
        if left < 0:  # earn only when short: the time since the last earning counts
            self._earn(now)
            left = self.left - frames
            if left < 0:
                return False
        self.left = left
        return True

    def most(self, now: float) -> int:
        """The most frames the direction may take at `now`."""
        self._earn(now)
        return int(self.left)

    def take(self, frames: int) -> None:
        """Take `frames`, no more than `most` said."""
        self.left -= frames

    def _earn(self, now: float) -> None:
        self.left = min(self.held, self.left + (now - self.at) * self.per_second)
        self.at = now


def scan_budget(now: float) -> FrameBudget:
    """One direction's frame headers to scan, full at the start."""
    return FrameBudget(now, SCAN_PER_SECOND, SCAN_HELD, SCAN_HELD)


def inflate_budget(now: float) -> FrameBudget:
    """One direction's bytes to inflate (permessage-deflate), full at the start."""
    return FrameBudget(now, INFLATE_PER_SECOND, INFLATE_HELD, INFLATE_HELD)
