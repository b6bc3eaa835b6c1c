"""The one rule both data paths apply to a response's transfer codings
(proxy/server/protocol.py `refused_codings`): `chunked` alone (in any case, with any
spaces) or none is taken; any other coding, under the chunks or last, is refused. The
proxy's answers to each are tests/hostile/test_upstream.py's and
tests/hostile/test_response_framing.py's."""

from __future__ import annotations

import pytest

from proxy.server.protocol import refused_codings
from tests.server.conftest import no_proxy

pytestmark = no_proxy


@pytest.mark.parametrize("lines", [[], [b"chunked"], [b"Chunked "], [b" CHUNKED"]])
def test_chunks_alone_or_no_coding_are_taken(lines: list[bytes]) -> None:
    assert refused_codings([(b"transfer-encoding", line) for line in lines]) is None


@pytest.mark.parametrize(
    ("lines", "said"),
    [
        ([b"gzip, chunked"], "gzip, chunked"),
        ([b"gzip", b"chunked"], "gzip, chunked"),
        ([b"GZIP ,Chunked"], "gzip, chunked"),
        ([b"chunked, chunked"], "chunked, chunked"),
        ([b"identity, chunked"], "identity, chunked"),
        ([b"gzip"], "gzip"),  # the last coding is no chunked: it frames nothing
        ([b"chunked, gzip"], "chunked, gzip"),
        ([b"identity"], "identity"),
    ],
)
def test_any_other_coding_is_refused(lines: list[bytes], said: str) -> None:
    headers = [(b"content-type", b"text/event-stream")]
    headers += [(b"transfer-encoding", line) for line in lines]
    refusal = refused_codings(headers)
    assert refusal is not None and f"transfer-encoding: {said}" in refusal
