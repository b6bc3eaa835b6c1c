"""A WebSocket message over the frame reader's bound: skipped, and the reader reads on.

vLLM's realtime server takes messages up to uvicorn's `ws_max_size` (16 MiB), so an
`input_audio_buffer.append` of 98 s of audio (4.2 MB of base64) is one it transcribes,
over `--max-event-bytes`' 4 MiB. Such a message once broke the reader, and the whole
session went unmeasured from there; now it comes out as one TOO_LARGE message (no data)
and every message after it is read as before, compressed (permessage-deflate, with and
without context takeover) or not, whole or in fragments, at every split of the reads.
Frames are written by wsproto's own FrameProtocol, as in tests/core/test_wsframes.py.
"""

from __future__ import annotations

import random
import tracemalloc

import pytest

from proxy.core.wsframes import (
    MAX_SKIPPED_INFLATE_BYTES,
    TOO_LARGE,
    FrameError,
    FrameReader,
    deflate_params,
)
from tests.core.test_wsframes import _writer

BOUND = 1000
NO_TAKEOVER = "permessage-deflate; client_no_context_takeover; server_no_context_takeover"


def _noise(n: int, seed: int) -> str:
    """Text that deflates to about half its size: an oversized message stays oversized."""
    return random.Random(seed).randbytes((n + 1) // 2).hex()[:n]


def _read(from_client: bool, extensions: str | None, data: bytes, cuts: list[int]) -> list:
    reader = FrameReader(from_client, deflate_params(extensions), max_message_bytes=BOUND)
    got = []
    for start, end in zip([0, *cuts], [*cuts, len(data)], strict=True):
        got += reader.feed(data[start:end], float(start))
    return [(m.kind, m.data) for m in got]


@pytest.mark.parametrize("extensions", [None, "permessage-deflate", NO_TAKEOVER])
@pytest.mark.parametrize("from_client", [True, False])
def test_the_messages_after_one_over_the_bound_are_read(
    from_client: bool, extensions: str | None
) -> None:
    w = _writer(from_client, extensions)
    small, big = _noise(200, 1), _noise(5 * BOUND, 2)
    frames = [
        w.send_data(small),
        w.send_data(big),  # one frame, over the bound
        w.send_data(small),  # with context takeover: inflated against the skipped one
        w.send_data(big[:600], fin=False),  # in fragments, over it from the second one
        w.ping(b"p"),
        w.send_data(big[600:1200], fin=False),
        w.send_data(big[1200:], fin=False),
        w.send_data("", fin=True),  # its last fragment empty
        w.send_data(big[:BOUND]),  # exactly the bound: read whole
        w.send_data(small),
        w.close(1000, "bye"),
    ]
    data = b"".join(bytes(f) for f in frames)
    expected = [
        ("text", small.encode()),
        (TOO_LARGE, b""),
        ("text", small.encode()),
        ("ping", b"p"),
        (TOO_LARGE, b""),
        ("text", big[:BOUND].encode()),
        ("text", small.encode()),
        ("close", b"bye"),
    ]
    assert _read(from_client, extensions, data, []) == expected
    step = max(1, len(data) // 97)  # many splits, a few hundred bytes apart
    assert _read(from_client, extensions, data, list(range(1, len(data), step))) == expected
    for cut in range(1, len(data), 331):  # every two-way split, sampled
        assert _read(from_client, extensions, data, [cut]) == expected, cut


@pytest.mark.parametrize("extensions", [None, "permessage-deflate", NO_TAKEOVER])
def test_a_skipped_message_is_not_held(extensions: str | None) -> None:
    """8 MiB over a 1 MiB bound, read 64 KiB at a time: the reader holds about the bound
    (the one piece that shows it was passed), never the message."""
    w = _writer(True, extensions)
    data = bytes(w.send_data(_noise(8 << 20, 3).encode())) + bytes(w.send_data("after"))
    reader = FrameReader(True, deflate_params(extensions), max_message_bytes=1 << 20)
    got = []
    tracemalloc.start()
    try:
        for i in range(0, len(data), 65536):
            got += reader.feed(data[i : i + 65536], 0.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [(m.kind, m.data) for m in got] == [(TOO_LARGE, b""), ("text", b"after")]
    assert peak < 3 << 20, peak


def test_a_deflate_bomb_past_the_skipping_ceiling_stops_the_reader() -> None:
    """With context takeover a skipped message is inflated (and dropped) to keep the
    window: at most MAX_SKIPPED_INFLATE_BYTES of it, which no vLLM behind uvicorn takes
    (it closes 1009): past that the reader gives up, as it did for any large message."""
    w = _writer(True, "permessage-deflate")
    frame = bytes(w.send_data(b"\x00" * (MAX_SKIPPED_INFLATE_BYTES + 1)))
    assert len(frame) < 100_000
    reader = FrameReader(True, deflate_params("permessage-deflate"), max_message_bytes=BOUND)
    with pytest.raises(FrameError, match="1009"):
        reader.feed(frame, 0.0)


def test_without_context_takeover_a_bomb_is_skipped_uninflated() -> None:
    """No window to keep: the rest of the message is dropped unread, however it inflates."""
    w = _writer(True, NO_TAKEOVER)
    data = bytes(w.send_data(b"\x00" * (MAX_SKIPPED_INFLATE_BYTES * 2))) + bytes(
        w.send_data("after")
    )
    reader = FrameReader(True, deflate_params(NO_TAKEOVER), max_message_bytes=BOUND)
    assert [(m.kind, m.data) for m in reader.feed(data, 0.0)] == [
        (TOO_LARGE, b""),
        ("text", b"after"),
    ]
