"""The one rule both data paths apply to a response's transfer codings
(proxy/server/protocol.py `coded_under_chunks`): a coding under the chunks is refused,
a coding that comes last frames nothing and is no refusal (the body runs to the close).
The proxy's answers to each are tests/hostile/test_upstream.py's."""

from __future__ import annotations

import pytest

from proxy.server.protocol import coded_under_chunks
from tests.server.conftest import no_proxy

pytestmark = no_proxy


@pytest.mark.parametrize(
    "lines",
    [
        [],
        [b"chunked"],
        [b"Chunked "],
        [b"gzip"],  # the last coding is no chunked: to the close
        [b"chunked, gzip"],
    ],
)
def test_chunks_alone_or_a_last_coding_are_taken(lines: list[bytes]) -> None:
    assert coded_under_chunks([(b"transfer-encoding", line) for line in lines]) is None


@pytest.mark.parametrize(
    ("lines", "said"),
    [
        ([b"gzip, chunked"], "gzip, chunked"),
        ([b"gzip", b"chunked"], "gzip, chunked"),
        ([b"GZIP ,Chunked"], "gzip, chunked"),
        ([b"chunked, chunked"], "chunked, chunked"),
        ([b"identity, chunked"], "identity, chunked"),
    ],
)
def test_a_coding_under_the_chunks_is_refused(lines: list[bytes], said: str) -> None:
    headers = [(b"content-type", b"text/event-stream")]
    headers += [(b"transfer-encoding", line) for line in lines]
    refusal = coded_under_chunks(headers)
    assert refusal is not None and f"transfer-encoding: {said}" in refusal
