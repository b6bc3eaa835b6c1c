"""A stream its backend may replay is never asked for usage (proxy/server/admission.py,
RESUMABLE_STREAM): llama-server keeps the bytes of a stream sent with `X-Conversation-Id`
and replays them on `GET /v1/stream?conv_id=<id>&from=N`, so a usage chunk the proxy
asked for and took out would be in the replay. Decided on the header alone, whatever the
backend (here one the proxy does not know). The real llama-server's replay through the
proxy: tests/llamacpp/test_real_llamacpp.py.
"""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry

from proxy.server.admission import relay_settings, where_to
from proxy.server.assemble import assemble
from proxy.server.exchange import Context
from proxy.server.rules import ExchangeRules
from proxy.settings import parse
from tests.server.conftest import no_proxy

pytestmark = no_proxy

CHAT = b"/v1/chat/completions"
STREAM_BODY = json.dumps(
    {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
).encode()


def admitted(headers: list[tuple[bytes, bytes]]) -> tuple[bytes, bool]:
    """The body that goes upstream for a chat stream with `headers`, and whether the
    client's stream would be stripped."""
    settings = parse(["--upstream", "http://10.0.0.9:8000"], {})
    app = assemble(settings, {}, registry=CollectorRegistry())
    context = Context(app.sinks, None, relay_settings(settings))
    head = [(b"content-type", b"application/json"), *headers]
    rules = ExchangeRules(context, "POST", where_to(CHAT, b""), CHAT, head, 1.0, 1000.0)
    rules.body(STREAM_BODY)
    return rules.admit(2.0).body, rules.stripper is not None


@pytest.mark.parametrize("value", [b"conv-1", b""])
def test_a_stream_with_a_conversation_id_goes_as_it_came_and_is_not_stripped(
    value: bytes,
) -> None:
    assert admitted([(b"x-conversation-id", value)]) == (STREAM_BODY, False)


def test_a_stream_without_one_is_still_asked_for_usage() -> None:
    body, stripped = admitted([(b"x-request-id", b"conv-1")])
    assert json.loads(body)["stream_options"] == {"include_usage": True} and stripped
