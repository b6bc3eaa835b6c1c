"""The WebSocket frame reader and frame bounds, I/O-free, against frames wsproto writes.

Every session below is written by wsproto's own FrameProtocol (masked as a client writes,
unmasked as a server does; compressed by wsproto's PerMessageDeflate when negotiated),
then read back split every two ways, byte at a time and at Hypothesis-chosen points.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wsproto.extensions import PerMessageDeflate
from wsproto.frame_protocol import FrameProtocol

from proxy.core.wsframes import (
    TOO_LARGE,
    DeflateParams,
    FrameBounds,
    FrameError,
    FrameReader,
    WsMessage,
    close_frame,
    deflate_params,
)

Expected = list[tuple[str, bytes, int | None]]


def _writer(from_client: bool, extensions: str | None) -> FrameProtocol:
    exts = []
    if extensions is not None:
        pmd = PerMessageDeflate()
        pmd.finalize(extensions)
        exts.append(pmd)
    return FrameProtocol(client=from_client, extensions=exts)


def _session(from_client: bool, extensions: str | None) -> tuple[list[bytes], Expected]:
    """A session's frames in order and the messages they make."""
    w = _writer(from_client, extensions)
    text = "héllo, wörld " + " ".join(str(i * 7919 % 10007) for i in range(300))
    blob = bytes(range(256)) * 300  # 76,800 bytes: over 65535, so an 8-byte length
    frames = [
        w.send_data(text),
        w.send_data(b"\x00\x01binary"),
        w.send_data("frag-", fin=False),
        w.ping(b"p1"),  # a control frame between fragments
        w.send_data("ment-", fin=False),
        w.send_data("ed", fin=True),
        w.pong(b"p1"),
        w.send_data(blob),
        w.send_data(""),  # an empty message
        w.send_data(text),  # same text again: with context takeover it compresses to little
        w.close(4001, "bye ✓"),
    ]
    expected: Expected = [
        ("text", text.encode(), None),
        ("binary", b"\x00\x01binary", None),
        ("ping", b"p1", None),
        ("text", b"frag-ment-ed", None),
        ("pong", b"p1", None),
        ("binary", blob, None),
        ("text", b"", None),
        ("text", text.encode(), None),
        ("close", "bye ✓".encode(), 4001),
    ]
    return [bytes(f) for f in frames], expected


DEFLATES = {
    "plain": None,
    "deflate": "permessage-deflate",
    "no_context_takeover": (
        "permessage-deflate; client_no_context_takeover; server_no_context_takeover"
    ),
    "small_windows": "permessage-deflate; client_max_window_bits=9; server_max_window_bits=10",
}
CASES = [(d, fc) for d in DEFLATES for fc in (True, False)]


def _read(chunks: Iterable[bytes], from_client: bool, extensions: str | None) -> list[WsMessage]:
    reader = FrameReader(from_client, deflate_params(extensions))
    out: list[WsMessage] = []
    for i, chunk in enumerate(chunks):
        out.extend(reader.feed(chunk, float(i)))
    return out


def _shape(messages: list[WsMessage]) -> Expected:
    return [(m.kind, m.data, m.close_code) for m in messages]


@pytest.mark.parametrize(("deflate", "from_client"), CASES)
def test_whole_session_in_one_read(deflate: str, from_client: bool) -> None:
    frames, expected = _session(from_client, DEFLATES[deflate])
    got = _read([b"".join(frames)], from_client, DEFLATES[deflate])
    assert _shape(got) == expected
    assert all(m.from_client is from_client and m.at == 0.0 for m in got)


@pytest.mark.parametrize(("deflate", "from_client"), CASES)
def test_frame_by_frame_stamps_each_message_with_its_read(deflate: str, from_client: bool) -> None:
    frames, expected = _session(from_client, DEFLATES[deflate])
    got = _read(frames, from_client, DEFLATES[deflate])
    assert _shape(got) == expected
    # The fragmented text completes in frame 5 (index 5), its ping came in frame 3.
    assert [m.at for m in got] == [0.0, 1.0, 3.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]


@pytest.mark.parametrize(("deflate", "from_client"), CASES)
def test_byte_at_a_time(deflate: str, from_client: bool) -> None:
    frames, expected = _session(from_client, DEFLATES[deflate])
    data = b"".join(frames)
    got = _read((data[i : i + 1] for i in range(len(data))), from_client, DEFLATES[deflate])
    assert _shape(got) == expected


@pytest.mark.parametrize(("deflate", "from_client"), CASES)
def test_every_two_way_split_of_the_small_frames(deflate: str, from_client: bool) -> None:
    frames, expected = _session(from_client, DEFLATES[deflate])
    small = b"".join(frames[1:7])  # binary, fragments with a ping inside, pong
    small_expected = expected[1:5]
    for cut in range(len(small) + 1):
        got = _read([small[:cut], small[cut:]], from_client, DEFLATES[deflate])
        assert _shape(got) == small_expected, cut


@settings(max_examples=60)
@given(
    deflate=st.sampled_from(sorted(DEFLATES)),
    from_client=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=100_000), max_size=30),
)
def test_random_splits(deflate: str, from_client: bool, cuts: list[int]) -> None:
    frames, expected = _session(from_client, DEFLATES[deflate])
    data = b"".join(frames)
    points = sorted({c % (len(data) + 1) for c in cuts})
    chunks = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    assert _shape(_read(chunks, from_client, DEFLATES[deflate])) == expected


def test_context_takeover_is_followed_across_messages() -> None:
    """With context takeover a repeated text compresses to a back-reference into the first
    message: read alone, without that window, it cannot be inflated."""
    text = " ".join(str(i * 7919 % 10007) for i in range(300))
    w = _writer(True, "permessage-deflate")
    first, again = bytes(w.send_data(text)), bytes(w.send_data(text))
    assert len(again) < len(first) // 4
    params = deflate_params("permessage-deflate")
    got = FrameReader(True, params).feed(first + again, 0.0)
    assert _shape(got) == [("text", text.encode(), None)] * 2
    with pytest.raises(FrameError):
        FrameReader(True, params).feed(again, 0.0)


def test_bytes_after_a_close_frame_are_ignored() -> None:
    w = _writer(False, None)
    reader = FrameReader(False, None)
    got = reader.feed(bytes(w.close(1000, "")) + b"\xff\xff garbage", 1.0)
    assert _shape(got) == [("close", b"", 1000)]
    assert reader.feed(b"more", 2.0) == []


def test_close_without_a_code() -> None:
    w = _writer(True, None)
    assert _shape(FrameReader(True, None).feed(bytes(w.close()), 0.0)) == [("close", b"", None)]


def test_a_deflate_bomb_is_skipped_not_held() -> None:
    """4 MiB of zeros deflate to about 4 KiB; over the reader's bound it is skipped, never
    held (tests/core/test_wsframes_oversize.py: what follows it is read, and a bomb past
    MAX_SKIPPED_INFLATE_BYTES stops the reader)."""
    w = _writer(False, "permessage-deflate")
    frame = bytes(w.send_data(b"\x00" * (4 * 1024 * 1024)))
    assert len(frame) < 10_000
    reader = FrameReader(False, deflate_params("permessage-deflate"), max_message_bytes=1 << 20)
    assert _shape(reader.feed(frame, 0.0)) == [(TOO_LARGE, b"", None)]


def test_an_uncompressed_message_over_the_bound_is_skipped() -> None:
    w = _writer(True, None)
    reader = FrameReader(True, None, max_message_bytes=1000)
    assert _shape(reader.feed(bytes(w.send_data(b"x" * 1001)), 0.0)) == [(TOO_LARGE, b"", None)]


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\x83\x00", "opcode"),  # opcode 3 is reserved
        (b"\x80\x00", "continuation"),  # a continuation with no message begun
        (b"\x09\x00", "fragment"),  # a ping without FIN
        (b"\x81\x81abcdx", "masked"),  # a masked frame from the upstream
        (b"\xc1\x00", "Reserved bit"),  # RSV1 without permessage-deflate negotiated
    ],
)
def test_frames_that_cannot_be_followed(data: bytes, why: str) -> None:
    with pytest.raises(FrameError, match=why):
        FrameReader(False, None).feed(data, 0.0)


def test_unmasked_frames_from_a_client_are_an_error() -> None:
    with pytest.raises(FrameError, match="unmasked"):
        FrameReader(True, None).feed(b"\x81\x02hi", 0.0)


def test_a_new_message_inside_a_fragmented_one_is_an_error() -> None:
    w = _writer(False, None)
    data = bytes(w.send_data("a", fin=False)) + bytes(_writer(False, None).send_data("b"))
    with pytest.raises(FrameError, match="continuation"):
        FrameReader(False, None).feed(data, 0.0)


def test_deflate_params_from_the_servers_answer() -> None:
    assert deflate_params(None) is None
    assert deflate_params("x-webkit-deflate-frame") is None
    assert deflate_params("permessage-deflate") == DeflateParams()
    assert deflate_params(
        'foo, permessage-deflate; server_no_context_takeover; client_max_window_bits="10"'
    ) == DeflateParams(server_no_context_takeover=True, client_max_window_bits=10)
    assert deflate_params("permessage-deflate; server_max_window_bits=8") == DeflateParams(
        server_max_window_bits=9
    )
    with pytest.raises(FrameError, match="window"):
        deflate_params("permessage-deflate; client_max_window_bits=16")
    with pytest.raises(FrameError, match="unknown parameter"):
        deflate_params("permessage-deflate; color=blue")


def test_an_eight_bit_window_reads_what_zlib_wrote_with_nine() -> None:
    """RFC 7692 allows 8; zlib's raw deflate does not, and writes a 9-bit window for it."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, -9)
    payload = compressor.compress(b"abc" * 50) + compressor.flush(zlib.Z_SYNC_FLUSH)
    frame = bytes((0xC1, len(payload[:-4]))) + payload[:-4]
    params = deflate_params("permessage-deflate; server_max_window_bits=8")
    assert _shape(FrameReader(False, params).feed(frame, 0.0)) == [("text", b"abc" * 50, None)]


# -- frame bounds ---------------------------------------------------------------------------


def _bounds_after(chunks: Iterable[bytes]) -> FrameBounds:
    bounds = FrameBounds()
    for chunk in chunks:
        bounds.feed(chunk)
    return bounds


@pytest.mark.parametrize(("deflate", "from_client"), CASES)
def test_bounds_at_every_frame_end_and_nowhere_inside(deflate: str, from_client: bool) -> None:
    frames, _ = _session(from_client, DEFLATES[deflate])
    data = b"".join(frames)
    ends = set()
    pos = 0
    for frame in frames:
        pos += len(frame)
        ends.add(pos)
    bounds = FrameBounds()
    for i in range(len(data)):
        bounds.feed(data[i : i + 1])
        assert bounds.at_boundary is (i + 1 in ends), i
        assert bounds.closed is (i + 1 == len(data))


@settings(max_examples=60)
@given(cuts=st.lists(st.integers(min_value=0, max_value=100_000), max_size=20))
def test_bounds_with_random_splits(cuts: list[int]) -> None:
    frames, _ = _session(True, "permessage-deflate")
    data = b"".join(frames[:-1])
    points = sorted({c % (len(data) + 1) for c in cuts})
    chunks = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    bounds = _bounds_after(chunks)
    assert bounds.at_boundary and not bounds.closed and not bounds.lost


def test_bounds_lose_track_of_what_is_not_frames() -> None:
    bounds = _bounds_after([b"GET / HTTP/1.1\r\n"])
    assert bounds.lost and not bounds.at_boundary


def test_bounds_read_at_most_the_headers_they_may_and_then_are_lost() -> None:
    """`feed(data, most)`: a read of more frame headers than `most` stops at the first
    past it and loses the direction (the next header cannot be found again); a read of as
    many, split anywhere, stays followed."""
    ping = bytes([0x89, 0x00])  # an empty unmasked ping: a 2-byte frame
    bounds = FrameBounds()
    assert bounds.feed(ping * 5, most=5)
    assert bounds.frames == 5 and bounds.at_boundary
    assert bounds.feed(ping * 2 + ping[:1], most=3)  # the third header's start only
    assert bounds.feed(ping[1:], most=1) and bounds.frames == 8 and bounds.at_boundary
    assert not bounds.feed(ping * 4, most=3)
    assert bounds.lost and bounds.frames == 11 and not bounds.at_boundary
    assert bounds.feed(ping) and bounds.frames == 11  # lost: nothing is read any more
    unlimited = FrameBounds()
    assert unlimited.feed(ping * 10_000) and unlimited.frames == 10_000


def test_the_proxys_close_frames_read_as_close_frames() -> None:
    for masked in (True, False):
        frame = close_frame(1001, "proxy shutting down", masked=masked)
        got = FrameReader(masked, None).feed(frame, 0.0)
        assert _shape(got) == [("close", b"proxy shutting down", 1001)]
        assert _bounds_after([frame]).closed


def test_a_message_in_tiny_fragments_holds_about_its_payload() -> None:
    """20,000 one-byte fragments: the reader holds their bytes, not an object each (a
    bytes object a fragment held 42 bytes a payload byte: 4 MiB of payload cost 176 MB)."""
    import tracemalloc

    def frame(opcode: int, fin: bool, payload: bytes) -> bytes:
        masked = bytes(c ^ b"abcd"[i % 4] for i, c in enumerate(payload))
        return bytes([(0x80 if fin else 0) | opcode, 0x80 | len(payload)]) + b"abcd" + masked

    reader = FrameReader(True, None, 4 << 20)
    frames = [frame(1, False, b"x"), *[frame(0, False, b"y")] * 20_000]
    tracemalloc.start()
    try:
        for i in range(0, len(frames), 100):
            assert reader.feed(b"".join(frames[i : i + 100]), 0.0) == []
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < 3 * 20_001, held
    (message,) = reader.feed(frame(0, True, b"z"), 0.0)
    assert message.data == b"x" + b"y" * 20_000 + b"z" and message.kind == "text"
