"""WebSocket frames read on the side of a byte tunnel: bytes in, messages out, no I/O.

Two readers per tunnel, one per direction. `FrameBounds` is the tunnel's own: it reads
only frame headers (a few bytes per frame, no unmasking) to know where frames end, so the
proxy can put a close frame between two frames at shutdown, and which side sent a close
frame first. `FrameReader` is what an API seam watches (proxy/core/wsseam.py): it unmasks,
reassembles fragmented messages, inflates permessage-deflate (RFC 7692) and yields each
message and control frame with the time of the read that completed it.

Framing is wsproto's (`wsproto.frame_protocol.FrameDecoder`: header, lengths, masking,
the rules for control frames). Inflating is ours, as a wsproto `Extension`, because
wsproto's own `PerMessageDeflate` inflates without a bound: a few KiB of deflated zeros
would become gigabytes in the watcher. A message larger than `max_message_bytes` (once
inflated) is not held: its bytes are dropped as they come and, at its end, the reader
yields a `TOO_LARGE` message in its place (no data) and reads on, so one large message
(a realtime append of minutes of audio) costs the session that message's content, not the
rest of its measuring. With context takeover the next message's inflating needs the
skipped one's output, so it is inflated and thrown away in bounded pieces, up to
`MAX_SKIPPED_INFLATE_BYTES`; a message inflating past that, and anything wsproto refuses,
is a `FrameError`: the tunnel then stops watching and the bytes go on flowing.

What a reader holds of a message in progress is counted in a `HeldBytes` that every
reader of a worker shares: the bound per message holds one reader to `max_message_bytes`,
and the shared one holds them all together (a peer holding a message half-sent in each
of 40 tunnels held 160 MB). A piece that would take the count past its bound is not
held: that message is skipped as an oversized one is, and the reader yields an `UNHELD`
message in its place at once (not at its end: a peer may hold it open for as long). One
integer moves, only for the pieces held across frames or reads: a message whole in one
read never touches it.

Inflating costs the loop by what it makes, not by what came: 3.9 KB of deflated "a"s is
4 MB to inflate, some 17 ms of a core with wsproto's copies of it. So `feed` takes the
most bytes it may inflate (`inflate_most`, the tunnel's budget, earned with time:
proxy/server/tunnel/budget.py) and inflates piece by piece no further: a read that
would go past it raises `InflateBudgetSpent` (a `FrameError`) before inflating the piece
that would, and `inflated` says how much the last `feed` inflated. Uncompressed frames
never ask.

The negotiated permessage-deflate parameters come from the upstream's 101 response
(`deflate_params(Sec-WebSocket-Extensions)`): the server's answer is what both ends use.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass

from wsproto.extensions import Extension
from wsproto.frame_protocol import (
    CloseReason,
    FrameDecoder,
    Opcode,
    ParseFailed,
    RsvBits,
)

#: WsMessage.kind for each opcode the reader yields.
KINDS = {
    Opcode.TEXT: "text",
    Opcode.BINARY: "binary",
    Opcode.PING: "ping",
    Opcode.PONG: "pong",
    Opcode.CLOSE: "close",
}
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
#: WsMessage.kind of a data message over the reader's bound, relayed but not read.
TOO_LARGE = "too_large"
#: WsMessage.kind of a data message relayed but not read because holding it would have
#: taken the readers' shared count (`HeldBytes`) past its bound; yielded as its skipping
#: begins, stamped with that read's time.
UNHELD = "unheld"
#: The most a compressed message is inflated to skip it (context takeover only: without
#: it nothing of a skipped message is inflated). uvicorn's default `ws_max_size`, which
#: vLLM's server runs with: it closes the session (1009) on any message inflating past
#: it, so nothing a real vLLM reads is lost by stopping there, and a deflate bomb costs
#: at most this much inflating (some 30 ms) before the watching stops.
MAX_SKIPPED_INFLATE_BYTES = 16 * 1024 * 1024
#: Inflated bytes produced (and dropped) at a time while skipping: the memory it takes.
_SKIP_PIECE = 64 * 1024


class FrameError(ValueError):
    """The bytes are not WebSocket frames the reader can follow; the message says why."""


class InflateBudgetSpent(FrameError):
    """A read would inflate past what `feed` was allowed (`inflate_most`): the reader
    stopped before inflating the piece that would, and stays broken."""


@dataclass(frozen=True, slots=True)
class WsMessage:
    """One message (reassembled, inflated) or control frame, from one side, at one read.

    `data` is the payload as bytes (a text message's UTF-8, not decoded); for a close
    frame it is the reason's UTF-8 and `close_code` the code (None when the frame had
    none, RFC 6455's 1005)."""

    from_client: bool
    # "text" | "binary" | "ping" | "pong" | "close" | TOO_LARGE | UNHELD (data is b"")
    kind: str
    data: bytes
    at: float  # perf_counter() of the read that completed it
    close_code: int | None = None


@dataclass(frozen=True, slots=True)
class DeflateParams:
    """permessage-deflate as the server accepted it (RFC 7692 §7.1)."""

    client_no_context_takeover: bool = False
    server_no_context_takeover: bool = False
    client_max_window_bits: int = 15
    server_max_window_bits: int = 15


def deflate_params(extensions: str | None) -> DeflateParams | None:
    """The permessage-deflate parameters in a 101's Sec-WebSocket-Extensions, or None.

    Raises FrameError for parameters the RFC does not allow in a server's answer, so a
    tunnel whose compression cannot be followed is not watched wrongly."""
    if not extensions:
        return None
    for offer in extensions.split(","):
        name, *params = (part.strip() for part in offer.split(";"))
        if name.lower() != "permessage-deflate":
            continue
        found: dict[str, object] = {}
        for param in params:
            key, _, value = (p.strip() for p in param.partition("="))
            key = key.lower()
            if key in ("client_no_context_takeover", "server_no_context_takeover"):
                found[key] = True
            elif key in ("client_max_window_bits", "server_max_window_bits"):
                bits = value.strip('"')
                if not bits.isdigit() or not 8 <= int(bits) <= 15:
                    raise FrameError(f"permessage-deflate: bad {key}={value!r}")
                # zlib refuses a raw window of 8 bits; 9 reads everything an 8 wrote.
                found[key] = max(int(bits), 9)
            elif key:
                raise FrameError(f"permessage-deflate: unknown parameter {key!r}")
        return DeflateParams(**found)  # type: ignore[arg-type]
    return None


class _Inflate(Extension):
    """permessage-deflate's inbound half for wsproto's FrameDecoder, with a size bound."""

    name = "permessage-deflate"

    def __init__(self, params: DeflateParams, from_client: bool, limit: int) -> None:
        self._bits = params.client_max_window_bits if from_client else params.server_max_window_bits
        self._reset = (
            params.client_no_context_takeover if from_client else params.server_no_context_takeover
        )
        self._limit = limit
        self._most = max(limit, MAX_SKIPPED_INFLATE_BYTES)  # inflated to skip a message
        self._inflater: zlib._Decompress | None = None
        self._control = False  # the frame being read is a control frame (never compressed)
        self._compressed: bool | None = None  # this message's RSV1, kept over its fragments
        self._out = 0  # inflated bytes of this message so far
        self.most = -1  # the most this `feed` may inflate (-1: no bound), and so far:
        self.spent = 0

    def _room(self, want: int) -> int:
        """`want` bytes of output, or what is left of this read's allowance: a piece of
        zlib's output is bounded before it is made (0 would mean no bound to zlib)."""
        if self.most < 0:
            return want
        left = self.most - self.spent
        if left <= 0:
            raise InflateBudgetSpent(f"inflating past {self.most} bytes in one read")
        return min(want, left)

    def enabled(self) -> bool:
        return True

    def offer(self) -> bool | str:
        return False  # only ever reads; the two ends negotiated

    def frame_inbound_header(
        self, proto: object, opcode: Opcode, rsv: RsvBits, payload_length: int
    ) -> CloseReason | RsvBits:
        if rsv.rsv1 and (opcode.iscontrol() or opcode is Opcode.CONTINUATION):
            return CloseReason.PROTOCOL_ERROR
        self._control = opcode.iscontrol()
        if not self._control and self._compressed is None:
            self._compressed = rsv.rsv1
            self._out = 0
            if rsv.rsv1 and self._inflater is None:
                self._inflater = zlib.decompressobj(-self._bits)
        return RsvBits(True, False, False)

    def frame_inbound_payload_data(self, proto: object, data: bytes) -> bytes | CloseReason:
        if self._control or not self._compressed or self._inflater is None or not data:
            return data
        return self._inflate(data)

    def frame_inbound_complete(self, proto: object, fin: bool) -> bytes | CloseReason | None:
        if self._control or not fin or self._compressed is None:
            return None  # a control frame, or a fragment of a message
        compressed, self._compressed = self._compressed, None
        if not compressed or self._inflater is None:
            return None
        tail = self._inflate(b"\x00\x00\xff\xff")
        if self._reset:
            self._inflater = None
        return tail

    def _inflate(self, data: bytes) -> bytes | CloseReason:
        inflater = self._inflater
        assert inflater is not None
        room = self._limit - self._out
        if room < 0:  # the message went over the bound: the reader is skipping it
            return self._skip(data)
        piece = self._room(room + 1)
        try:
            out = inflater.decompress(data, piece)
        except zlib.error:
            return CloseReason.INVALID_FRAME_PAYLOAD_DATA
        self._out += len(out)
        self.spent += len(out)
        if piece <= room and len(out) == piece:
            # The allowance, not the message's bound, stopped zlib: more may be coming,
            # and it is not made. (A message ending exactly there is taken for one that
            # goes on: a read that spends the whole allowance is over it anyway.)
            raise InflateBudgetSpent(f"inflating past {self.most} bytes in one read")
        if len(out) > room:
            # One byte over: the reader sees the message pass its bound and skips it.
            # What zlib still holds (input, or output it had no room for) is skipped too.
            rest = self._skip(inflater.unconsumed_tail)
            if isinstance(rest, CloseReason):
                return rest
        return out

    def _skip(self, data: bytes) -> bytes | CloseReason:
        """Nothing of a message over the bound; with context takeover its output still
        feeds the window the next message is inflated against, so it is inflated here,
        a piece at a time, and dropped."""
        if self._reset:
            return b""  # its inflater is dropped at the message's end, unread
        inflater = self._inflater
        assert inflater is not None
        try:
            while True:
                piece = self._room(_SKIP_PIECE)
                out = inflater.decompress(data, piece)
                self._out += len(out)
                self.spent += len(out)
                if self._out > self._most:
                    return CloseReason.MESSAGE_TOO_BIG
                data = inflater.unconsumed_tail
                if not data and len(out) < piece:
                    return b""
        except zlib.error:
            return CloseReason.INVALID_FRAME_PAYLOAD_DATA


class HeldBytes:
    """The bytes of half-received messages that every reader sharing it holds (`held`),
    and the most they may (`most`): one per worker, read and moved on one event loop."""

    __slots__ = ("held", "most")

    def __init__(self, most: int) -> None:
        self.most = most
        self.held = 0


class FrameReader:
    """One direction's frames -> messages. `from_client`: frames the client sends (masked).

    `feed` returns the messages and control frames completed by `data`, each stamped
    `now`; a data message over `max_message_bytes` comes as a `TOO_LARGE` one, without
    its data. The text of a message in progress is held, inflated, up to
    `max_message_bytes`: what an unfinished message can keep a reader holding, and
    counted in `held` (shared by the readers of every tunnel: a message it has no room
    for comes as an `UNHELD` one, without its data). After a close frame the direction is
    over; later bytes are ignored. Raises FrameError (and stays broken) on anything it
    cannot follow. `release()` gives back what it holds: its owner calls it when it
    drops the reader."""

    def __init__(
        self,
        from_client: bool,
        deflate: DeflateParams | None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        held: HeldBytes | None = None,
    ) -> None:
        self.from_client = from_client
        self._held = held
        extensions: list[Extension] = []
        self._inflate: _Inflate | None = None
        if deflate is not None:
            self._inflate = _Inflate(deflate, from_client, max_message_bytes)
            extensions.append(self._inflate)
        # wsproto's `client` is the reading end: frames from the client are read by a server.
        self._decoder = FrameDecoder(client=not from_client, extensions=extensions)
        self._limit = max_message_bytes
        self._opcode: Opcode | None = None  # the data message being reassembled
        # The message so far: one buffer, not a bytes object a fragment (a message sent in
        # 1-byte fragments held 42 bytes of memory a payload byte, past the bound's count)
        self._parts = bytearray()
        self._size = 0
        self._counted = 0  # bytes of `_parts` counted in `held`
        self._unheld = False  # the message in progress found no room in `held`: skipped
        self._closed = False
        self._broken: str | None = None

    @property
    def inflated(self) -> int:
        """Bytes the last `feed` inflated (permessage-deflate), whole or not."""
        return 0 if self._inflate is None else self._inflate.spent

    def feed(self, data: bytes, now: float, inflate_most: int = -1) -> list[WsMessage]:
        """`inflate_most`: the most bytes this read may inflate (-1: no bound); past it,
        InflateBudgetSpent, before the piece that would go past is inflated."""
        if self._broken is not None:
            raise FrameError(self._broken)
        if (inflate := self._inflate) is not None:
            inflate.most, inflate.spent = inflate_most, 0
        if self._closed or not data:
            return []
        out: list[WsMessage] = []
        decoder = self._decoder
        decoder.receive_bytes(data)
        try:
            while not self._closed:
                frame = decoder.process_buffer()
                if frame is None:
                    break
                payload = frame.payload
                assert isinstance(payload, bytes)  # FrameDecoder yields bytes, never text
                self._frame(
                    frame.opcode, payload, frame.frame_finished, frame.message_finished, now, out
                )
        except ParseFailed as exc:
            self._broken = f"{exc} (close code {int(exc.code)})"
            raise FrameError(self._broken) from None
        except FrameError as exc:
            self._broken = str(exc)
            raise
        return out

    def _frame(
        self,
        opcode: Opcode,
        payload: bytes,
        frame_done: bool,
        fin: bool,
        now: float,
        out: list[WsMessage],
    ) -> None:
        if opcode.iscontrol():  # never fragmented, and wsproto holds it until it is whole
            out.append(self._control(opcode, payload, now))
            return
        if opcode is Opcode.CONTINUATION:
            if self._opcode is None:
                raise FrameError("a continuation frame outside a message")
        elif self._opcode is not None:
            raise FrameError(f"expected a continuation frame, got {opcode.name}")
        else:
            self._opcode = opcode
        if payload:
            self._size += len(payload)
            if self._size > self._limit or self._unheld:
                self._skip(frame_done and fin, now, out)
                return
        if frame_done and fin:
            if self._size > self._limit or self._unheld:  # a skipped message's last frame
                self._skip(True, now, out)
                return
            kind = KINDS[self._opcode]
            if self._parts:  # the last of several pieces
                self._parts += payload
                data = bytes(self._parts)
                self.release()
            else:  # a message in one piece: as it came, no copy
                data = payload
            self._opcode, self._size = None, 0
            out.append(WsMessage(self.from_client, kind, data, now))
        elif payload:
            held = self._held
            if held is not None:
                if held.held + len(payload) > held.most:  # no room: not this message
                    # said now, not at its end: a peer may hold it open for as long
                    self._unheld = True
                    self.release()
                    out.append(WsMessage(self.from_client, UNHELD, b"", now))
                    return
                held.held += len(payload)
                self._counted += len(payload)
            self._parts += payload

    def _skip(self, done: bool, now: float, out: list[WsMessage]) -> None:
        """A piece of a message over the bound, or one `held` had no room for: dropped
        (with what was held of it); at its end, a TOO_LARGE message says one was relayed
        unread (an UNHELD one was said as its skipping began)."""
        self.release()
        if done:
            unheld = self._unheld
            self._opcode, self._size, self._unheld = None, 0, False
            if not unheld:
                out.append(WsMessage(self.from_client, TOO_LARGE, b"", now))

    def release(self) -> None:
        """Drop what is held of the message in progress, and give back to `held` what
        was counted in it."""
        if self._parts:
            self._parts = bytearray()
        if self._counted:
            held = self._held
            if held is not None:
                held.held -= self._counted
            self._counted = 0

    def _control(self, opcode: Opcode, payload: bytes, now: float) -> WsMessage:
        if opcode is not Opcode.CLOSE:
            return WsMessage(self.from_client, KINDS[opcode], payload, now)
        self._closed = True
        if not payload:
            return WsMessage(self.from_client, "close", b"", now, None)
        if len(payload) == 1:
            raise FrameError("a close frame with a 1-byte payload")
        (code,) = struct.unpack("!H", payload[:2])
        return WsMessage(self.from_client, "close", payload[2:], now, code)


class FrameBounds:
    """Where one direction's frames end, from their headers alone (no unmasking).

    `at_boundary` is true when every frame fed so far is complete; `closed` once a whole
    close frame has passed; `frames` counts the frame headers read. Anything that is not a
    frame header stops it (`lost`), and the tunnel then treats the direction as never at a
    boundary again. So does a read carrying more headers than `feed` may read (`most`):
    a flood of tiny frames cost the scan some 0.3 µs a frame, every frame of the read,
    and where it stops the next header cannot be found again."""

    __slots__ = ("_closing", "_head", "_left", "closed", "frames", "lost")

    def __init__(self) -> None:
        self._left = 0  # payload bytes of the current frame still to come
        self._head = b""  # a frame header split across reads
        self._closing = False  # the current frame is a close frame
        self.closed = False
        self.lost = False
        self.frames = 0

    @property
    def at_boundary(self) -> bool:
        return not self._left and not self._head and not self.lost

    def feed(self, data: bytes, most: int = -1) -> bool:
        """Follow `data`, reading at most `most` frame headers (-1: all of them). False
        when it stopped short of a header past `most`: it is then `lost`."""
        if self.lost:
            return True
        n = len(data)
        left = self._left
        if left >= n:  # the common case for large frames: all payload
            self._left = left = left - n
            if not left and self._closing:
                self.closed = True
            return True
        frames = self.frames
        limit = frames + most if most >= 0 else -1
        i = left
        if self._head:
            data = self._head + data
            n = len(data)
            self._head = b""
            i = 0
        elif left and self._closing:
            self.closed = True
        closing = False
        while i < n:
            if n - i < 2:
                self._head = data[i:]
                break
            b0, b1 = data[i], data[i + 1]
            length = b1 & 0x7F
            size = 2 + (4 if b1 & 0x80 else 0)
            if length == 126:
                size += 2
            elif length == 127:
                size += 8
            if n - i < size:
                self._head = data[i:]
                break
            if length == 126:
                (length,) = struct.unpack_from("!H", data, i + 2)
            elif length == 127:
                (length,) = struct.unpack_from("!Q", data, i + 2)
            opcode = b0 & 0x0F
            if opcode not in _OPCODES:
                self.lost = True
                self.frames = frames
                return True
            if frames == limit:
                self.lost = True
                self.frames = frames
                return False
            closing = opcode == 0x8
            frames += 1
            i += size + length
            if closing and i <= n:
                self.closed = True
        self.frames = frames
        self._left = i - n if i > n else 0
        self._closing = closing and self._left > 0
        return True


_OPCODES = frozenset((0x0, 0x1, 0x2, 0x8, 0x9, 0xA))


def close_frame(code: int, reason: str, *, masked: bool) -> bytes:
    """A close frame to write into a tunnel: masked towards the upstream (as a client's
    frames are), unmasked towards the client. Control frames are never compressed."""
    payload = struct.pack("!H", code) + reason.encode()[:123]
    if not masked:
        return bytes((0x88, len(payload))) + payload
    key = os.urandom(4)
    body = bytes(b ^ key[i % 4] for i, b in enumerate(payload))
    return bytes((0x88, 0x80 | len(payload))) + key + body
