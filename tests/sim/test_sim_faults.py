"""Faults inside a 200 stream, as a client sees them on the wire, and client disconnects."""

from __future__ import annotations

import itertools
import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from proxy.sim import SimApp, SimConfig, completion_text
from tests.servers import ThreadedServer
from tests.sim.test_sim_support import best_of, chat, read_events, running


@pytest.fixture(scope="module")
def sim() -> Iterator[tuple[ThreadedServer, SimApp]]:
    with running(SimConfig(ttft=0.02, tokens_per_second=200, output_tokens=6)) as pair:
        yield pair


def fault(name: str, after: int = 2, more: dict[str, str] | None = None) -> dict[str, str]:
    return {"x-sim-fault": name, "x-sim-fault-after": str(after), **(more or {})}


def test_error_event_follows_tokens_then_done(client: httpx.Client, url: str, app: SimApp) -> None:
    got = read_events(client, url, chat(), fault("error_event"))
    assert got.status == 200
    assert got.text() == completion_text(2)
    assert got.events[-2].json == {
        "error": {
            "message": "Internal server error",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }
    assert got.events[-1].data == b"[DONE]"
    assert not any(
        e.json.get("choices") and e.json["choices"][0]["finish_reason"] for e in got.events[:-1]
    )
    record = app.state.last()
    assert record is not None and record.outcome == "fault" and record.fault == "error_event"


def test_error_string_is_a_bare_string_error(client: httpx.Client, url: str) -> None:
    got = read_events(client, url, chat(), fault("error_string", after=0))
    assert got.contents() == []
    assert got.events[-2].json == {"error": "upstream generation failed"}
    assert got.events[-1].data == b"[DONE]"


def test_reset_drops_the_connection_mid_body(client: httpx.Client, url: str, app: SimApp) -> None:
    received = b""
    with (
        pytest.raises(httpx.RemoteProtocolError),
        client.stream(
            "POST", url + "/v1/chat/completions", json=chat(), headers=fault("reset", after=1)
        ) as response,
    ):
        assert response.status_code == 200
        for piece in response.iter_raw():
            received += piece
    assert completion_text(1).encode() in received
    assert b'"finish_reason":"stop"' not in received
    assert app.state.wait_for(lambda: (r := app.state.last()) is not None and r.outcome == "fault")


def test_close_no_done_ends_the_body_cleanly_without_finish(client: httpx.Client, url: str) -> None:
    got = read_events(client, url, chat(), fault("close_no_done", after=3))
    assert got.text() == completion_text(3)
    assert got.events[-1].is_content
    assert b"[DONE]" not in got.raw and b'finish_reason":"' not in got.raw


@pytest.mark.quiet("a timing read within tens of milliseconds")
def test_stall_pauses_then_continues_on_a_shifted_schedule(client: httpx.Client, url: str) -> None:
    def attempt() -> None:
        got = read_events(client, url, chat(), fault("stall", after=2, more={"x-sim-stall": "0.3"}))
        times = [e.at for e in got.contents()]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert 0.3 <= gaps[1] <= 0.3 + 0.005 + 0.03, gaps
        assert all(g < 0.05 for i, g in enumerate(gaps) if i != 1), gaps
        assert got.text() == completion_text(6)
        assert got.events[-1].data == b"[DONE]"

    best_of(3, attempt)


def test_malformed_event_is_sent_and_the_stream_goes_on(client: httpx.Client, url: str) -> None:
    with client.stream(
        "POST", url + "/v1/chat/completions", json=chat(), headers=fault("malformed")
    ) as response:
        raw = response.read()
    events = raw.split(b"\n\n")
    assert b"data: {not json" in events
    index = events.index(b"data: {not json")
    assert events[index - 1].count(b'"content"') == 1  # after two content chunks
    assert raw.endswith(b"data: [DONE]\n\n")
    assert raw.count(b'"delta":{"content":"') == 7  # 6 tokens and the finish chunk


def test_non_utf8_event_carries_raw_invalid_bytes(client: httpx.Client, url: str) -> None:
    with client.stream(
        "POST", url + "/v1/chat/completions", json=chat(), headers=fault("non_utf8")
    ) as response:
        raw = response.read()
    bad = [e for e in raw.split(b"\n\n") if b"\xff\xfe" in e]
    assert len(bad) == 1
    with pytest.raises(UnicodeDecodeError):
        bad[0].decode()
    assert raw.endswith(b"data: [DONE]\n\n")


def test_huge_event_is_one_valid_event_of_the_asked_size(client: httpx.Client, url: str) -> None:
    size = 200_000
    got = read_events(
        client, url, chat(), fault("huge_event", more={"x-sim-huge-bytes": str(size)})
    )
    huge = [e for e in got.events if len(e.data) > 10_000]
    assert len(huge) == 1
    assert len(b"data: ") + len(huge[0].data) + 2 == size
    assert set(huge[0].json["choices"][0]["delta"]["content"]) == {"x"}
    assert got.events[-1].data == b"[DONE]"


def test_default_huge_event_is_four_mebibytes(client: httpx.Client, url: str) -> None:
    with client.stream(
        "POST", url + "/v1/chat/completions", json=chat(), headers=fault("huge_event", after=0)
    ) as response:
        raw = response.read()
    assert max(len(e) + 2 for e in raw.split(b"\n\n")) == 4 * 1024 * 1024


def test_fault_after_the_last_token_fires_before_the_finish_chunk(
    client: httpx.Client, url: str
) -> None:
    got = read_events(client, url, chat(), fault("error_event", after=99))
    assert got.text() == completion_text(6)
    assert "error" in got.events[-2].json


def test_stall_before_headers_delays_the_status_line(client: httpx.Client, url: str) -> None:
    got = read_events(client, url, chat(), {"x-sim-stall-before-headers": "0.25"})
    assert got.headers_at >= 0.25
    response = client.post(
        url + "/v1/chat/completions",
        json=chat(),
        headers={"x-sim-stall-before-headers": "0.2", "x-sim-error": "server_error"},
    )
    assert response.status_code == 500
    assert response.elapsed.total_seconds() >= 0.2


# -- the client going away --------------------------------------------------------


@pytest.mark.quiet("a timing read within tens of milliseconds")
def test_disconnect_mid_stream_is_recorded_as_aborted(url: str, app: SimApp) -> None:
    headers = {"x-sim-output-tokens": "200", "x-sim-tps": "100"}
    with (
        httpx.Client() as client,
        client.stream(
            "POST", url + "/v1/chat/completions", json=chat(), headers=headers
        ) as response,
    ):
        seen = 0
        for line in response.iter_lines():
            seen += '"content":"' in line and '"role"' not in line
            if seen == 2:
                break
        closed_at = time.monotonic()
    assert app.state.wait_for(
        lambda: (r := app.state.last()) is not None and r.outcome == "aborted"
    )
    record = app.state.last()
    assert record is not None and record.aborted_at is not None
    assert record.aborted_at - closed_at < 0.1
    assert record.completion_tokens < 20
    sent = record.chunks_sent
    time.sleep(0.1)
    assert record.chunks_sent == sent, "generation stopped"
    assert app.state.active == 0


def test_disconnect_before_first_token_is_recorded_as_aborted(url: str, app: SimApp) -> None:
    with (
        httpx.Client() as client,
        client.stream(
            "POST",
            url + "/v1/chat/completions",
            json=chat(),
            # the role chunk with the headers: vLLM's comes with the first token
            headers={"x-sim-ttft": "2", "x-sim-early-role": "1"},
        ) as response,
    ):
        first = next(response.iter_lines())
        assert '"role":"assistant"' in first
    assert app.state.wait_for(
        lambda: (r := app.state.last()) is not None and r.outcome == "aborted"
    )
    record = app.state.last()
    assert record is not None and record.aborted_at is not None
    assert record.first_token_at is None
    assert record.aborted_at - record.started < 1.0


def test_disconnect_during_non_streaming_wait_is_recorded_as_aborted(url: str, app: SimApp) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            url + "/v1/chat/completions",
            json=chat(stream=False),
            headers={"x-sim-ttft": "2"},
            timeout=httpx.Timeout(5, read=0.2),
        )
    assert app.state.wait_for(
        lambda: (r := app.state.last()) is not None and r.outcome == "aborted"
    )
    record = app.state.last()
    assert record is not None and record.status == 0


def test_disconnect_before_the_body_arrives_is_recorded_as_aborted(
    sim: tuple[ThreadedServer, SimApp], app: SimApp
) -> None:
    app.state.reset()
    with socket.create_connection(("127.0.0.1", sim[0].port)) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n"
            b"content-type: application/json\r\n\r\n" + json.dumps({"a": 1}).encode()[:5]
        )
        assert app.state.wait_for(lambda: app.state.last() is not None)
    assert app.state.wait_for(
        lambda: (r := app.state.last()) is not None and r.outcome == "aborted"
    )
