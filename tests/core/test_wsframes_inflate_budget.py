"""The frame reader inflates no more than a read may (`FrameReader.feed`'s `inflate_most`).

3.9 KB of deflated "a"s is a 4 MB message: inflating and copying it held the loop some
17 ms, and 300 of them, 1.17 MB sent, held it 4 s. The reader is handed what its
direction may still inflate (proxy/server/tunnel/budget.py) and stops before it inflates
past it: `InflateBudgetSpent`, `inflated` at most the allowance, at every split of the
reads, on the message's own path and on the skipping of one over `max_message_bytes`
(context takeover inflates a skipped message to keep the window). Frames are written by
wsproto's own FrameProtocol, as in tests/core/test_wsframes.py.
"""

from __future__ import annotations

import pytest

from proxy.core.wsframes import FrameError, FrameReader, InflateBudgetSpent, deflate_params
from tests.core.test_wsframes import _writer

BOMB = "a" * 1_000_000  # deflates to about 1 KB
NO_TAKEOVER = "permessage-deflate; client_no_context_takeover; server_no_context_takeover"


def _bombs(from_client: bool, extensions: str, count: int) -> bytes:
    w = _writer(from_client, extensions)
    return b"".join(bytes(w.send_data(BOMB)) for _ in range(count))


@pytest.mark.parametrize("from_client", [True, False])
@pytest.mark.parametrize("extensions", ["permessage-deflate", NO_TAKEOVER])
def test_a_read_inflating_past_its_allowance_stops_before_it_does(
    from_client: bool, extensions: str
) -> None:
    data = _bombs(from_client, extensions, 10)
    assert len(data) < 20_000  # 10 MB once inflated
    reader = FrameReader(from_client, deflate_params(extensions), max_message_bytes=2_000_000)
    allowance = 2_500_000
    with pytest.raises(InflateBudgetSpent):
        reader.feed(data, 0.0, allowance)
    assert reader.inflated <= allowance
    with pytest.raises(FrameError):  # and stays broken: the watching stops
        reader.feed(data, 1.0, allowance)


@pytest.mark.parametrize("piece", [1, 7, 300, 1024, 5000])
def test_no_read_inflates_more_than_it_was_allowed_at_any_split(piece: int) -> None:
    """A message in fragments and reads of every size: each feed inflates at most what it
    was given, and the messages within the allowance come out whole."""
    w = _writer(True, "permessage-deflate")
    # one message of 800 KB, in two fragments
    frames = [w.send_data(BOMB[:400_000], fin=False), w.send_data(BOMB[:400_000], fin=True)]
    data = b"".join(bytes(f) for f in frames)
    reader = FrameReader(True, deflate_params("permessage-deflate"))
    got, spent = [], 0
    allowance = 900_000
    for start in range(0, len(data), piece):
        got += reader.feed(data[start : start + piece], float(start), allowance - spent)
        assert reader.inflated <= allowance - spent
        spent += reader.inflated
    assert [(m.kind, len(m.data)) for m in got] == [("text", 800_000)]
    assert spent == 800_000


def test_a_message_skipped_over_the_bound_is_charged_as_it_is_inflated() -> None:
    """With context takeover a message over `max_message_bytes` is still inflated (and
    dropped) to keep the window: that costs the same, and is charged the same."""
    data = _bombs(False, "permessage-deflate", 5)
    reader = FrameReader(False, deflate_params("permessage-deflate"), max_message_bytes=1000)
    with pytest.raises(InflateBudgetSpent):
        reader.feed(data, 0.0, 3_000_000)
    assert reader.inflated <= 3_000_000


def test_within_the_allowance_nothing_changes_and_uncompressed_frames_never_ask() -> None:
    w = _writer(True, "permessage-deflate")
    text = "héllo " * 100
    compressed = bytes(w.send_data(text)) + bytes(w.send_data(text))
    reader = FrameReader(True, deflate_params("permessage-deflate"))
    got = reader.feed(compressed, 0.0, 10 * len(text.encode()))
    assert [m.data for m in got] == [text.encode()] * 2
    assert reader.inflated == 2 * len(text.encode())
    # Uncompressed (no RSV1) where permessage-deflate was agreed, or not agreed at all:
    # nothing to inflate, so an allowance of nothing stops nothing.
    plain = bytes(_writer(True, None).send_data(text))
    for extensions in ("permessage-deflate", None):
        reader = FrameReader(True, deflate_params(extensions))
        got = reader.feed(plain, 0.0, 0)
        assert [m.data for m in got] == [text.encode()] and reader.inflated == 0
