"""When measuring breaks, the request still succeeds and still yields one record.

The failure is injected by making the request's API seam raise (the observer hands every
event to it), or by making the finish sequence raise. Either way: the client gets every
byte, one record reaches the sinks with what is known without the observer (status, e2e,
the transport's error type), `tokenprobe_measurement_failures_total{stage}` says so, and
the in-flight gauge is back to 0.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from proxy.core.apis.chat import Chat
from proxy.core.measurement import TokenSource
from proxy.core.observe import StreamObserver
from tests.builds import replaces_observer_methods
from tests.conftest import MODEL, ProxyUnderTest, Running

CHAT = "/v1/chat/completions"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
LABELS = {"model": MODEL, "endpoint": CHAT}


def one_record(proxy: ProxyUnderTest) -> Any:
    deadline = time.monotonic() + 5
    while not proxy.records and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # nothing else may follow
    assert len(proxy.records) == 1
    return proxy.records[0]


def test_failing_observer_still_yields_a_record(
    sim: Running, proxy: ProxyUnderTest, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = 0
    original = Chat.event

    def breaks_on_the_third_event(self: Chat, payload: bytes, collect: bool, ident: bool) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("measuring broke")
        return original(self, payload, collect, ident)

    monkeypatch.setattr(Chat, "event", breaks_on_the_third_event)
    reply = httpx.post(proxy.url + CHAT, json=BODY)
    assert reply.status_code == 200 and reply.content.endswith(b"data: [DONE]\n\n")
    m = one_record(proxy)
    assert (m.status_code, m.error_type, m.endpoint) == (200, None, CHAT)
    assert m.e2e > 0 and m.ttfb is not None
    # Nothing read from a stream that was only half observed.
    assert (m.ttft, m.output_tokens, m.token_source) == (None, None, TokenSource.NONE)
    assert proxy.sample("tokenprobe_measurement_failures_total", stage="observe") == 1
    assert proxy.sample("tokenprobe_requests_in_flight", **LABELS) == 0
    assert proxy.sample("tokenprobe_requests_total", **LABELS, code="200",
                        finish_reason="none", error_type="none") == 1  # fmt: skip
    assert calls == 3  # the observer was not fed again after it failed


@replaces_observer_methods
def test_failing_finish_still_yields_a_record(
    sim: Running, proxy: ProxyUnderTest, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(self: StreamObserver, **_: Any) -> Any:
        raise RuntimeError("finishing broke")

    monkeypatch.setattr(StreamObserver, "finish", broken)
    reply = httpx.post(proxy.url + CHAT, json=BODY)
    assert reply.status_code == 200
    m = one_record(proxy)
    assert (m.status_code, m.error_type, m.token_source) == (200, None, TokenSource.NONE)
    assert proxy.sample("tokenprobe_measurement_failures_total", stage="finish") == 1
    assert proxy.sample("tokenprobe_requests_in_flight", **LABELS) == 0
