"""How many frames the WebSocket watch may read one by one: earned with time, per direction.

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


class FrameBudget:
    """One direction's frames to read: `spend(frames, now)` takes them, or says no."""

    __slots__ = ("at", "left")

    def __init__(self, now: float) -> None:
        self.left = AT_START
        self.at = now  # when it last earned

    def spend(self, frames: int, now: float) -> bool:
        """Take `frames`, read at `now` (perf_counter); False, taking nothing, when the
        direction has not earned that many."""
        left = self.left - frames
        if left < 0:  # earn only when short: the time since the last earning counts
            self.left = min(HELD, self.left + (now - self.at) * PER_SECOND)
            self.at = now
            left = self.left - frames
            if left < 0:
                return False
        self.left = left
        return True
