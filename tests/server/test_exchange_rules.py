"""The exchange's rules without I/O (proxy/server/rules.py): events in, decisions out.

Both data paths carry these decisions out; the end-to-end suites check that they do. Here
the decisions themselves: no socket, no loop, the time passed in.
"""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry

from proxy.core.errors import Cause
from proxy.server.admission import BODY_TIMEOUT, Refused, relay_settings, where_to
from proxy.server.assemble import assemble
from proxy.server.exchange import Context
from proxy.server.rules import ExchangeRules, Stage
from proxy.settings import parse
from tests.server.conftest import no_proxy

pytestmark = no_proxy

CHAT = b"/v1/chat/completions"
STREAM_BODY = json.dumps(
    {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
).encode()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def context(registry: CollectorRegistry, *flags: str) -> Context:
    settings = parse(["--upstream", "http://10.0.0.9:8000/tenant-a/", *flags], {})
    app = assemble(settings, {}, registry=registry)
    return Context(app.sinks, None, relay_settings(settings))


def rules_for(
    ctx: Context,
    raw_path: bytes = CHAT,
    query: bytes = b"",
    method: str = "POST",
    headers: list[tuple[bytes, bytes]] | None = None,
) -> ExchangeRules:
    head = [(b"content-type", b"application/json")] if headers is None else headers
    return ExchangeRules(ctx, method, where_to(raw_path, query), raw_path, head, 1.0, 1000.0)


def test_a_target_that_cannot_be_normalised_is_refused_before_anything_goes_upstream(
    registry: CollectorRegistry,
) -> None:
    rules = rules_for(context(registry), raw_path=b"/v1/../../etc/passwd")
    assert rules.stage is Stage.REFUSED
    assert rules.refusal is not None
    assert (rules.refusal.status, rules.refusal.kind) == (400, "invalid_request_target")
    assert rules.body(b"{}") is None and rules.parts == []  # the rest is dropped


def test_head_limits_refuse_with_431_and_a_declared_body_over_the_limit_with_413(
    registry: CollectorRegistry,
) -> None:
    ctx = context(registry, "--max-header-bytes", "100", "--max-body-bytes", "10")
    big = rules_for(ctx, headers=[(b"x-pad", b"a" * 200)])
    assert big.refusal is not None and big.refusal.status == 431
    declared = rules_for(ctx, headers=[(b"content-length", b"11")])
    assert declared.refusal is not None and declared.refusal.status == 413


def test_the_body_is_refused_at_the_piece_that_passes_the_limit_and_the_rest_dropped(
    registry: CollectorRegistry,
) -> None:
    rules = rules_for(context(registry, "--max-body-bytes", "10"))
    assert rules.body(b"12345") is None
    refusal = rules.body(b"678901")
    assert isinstance(refusal, Refused) and refusal.status == 413
    assert rules.stage is Stage.REFUSED and rules.parts == []
    assert rules.body(b"x") is None  # answered already


def requests(registry: CollectorRegistry, code: str, error_type: str) -> float | None:
    return registry.get_sample_value(
        "tokenprobe_requests_total",
        {
            "model": "other",
            "endpoint": "/v1/chat/completions",
            "code": code,
            "finish_reason": "none",
            "error_type": error_type,
        },
    )


def test_a_refusal_is_counted_as_a_bare_record_of_its_api(registry: CollectorRegistry) -> None:
    rules = rules_for(context(registry))
    rules.refuse(BODY_TIMEOUT)
    rules.refused()
    assert requests(registry, "408", "bad_request") == 1


def test_admit_keeps_the_upstreams_base_path_and_the_query_and_asks_a_stream_for_usage(
    registry: CollectorRegistry,
) -> None:
    rules = rules_for(context(registry), raw_path=b"/v1/x/../chat/completions", query=b"a=1")
    rules.body(STREAM_BODY[:10])
    rules.body(STREAM_BODY[10:])
    upstream = rules.admit(2.0)
    assert upstream.target == "/tenant-a/v1/chat/completions?a=1"
    assert json.loads(upstream.body)["stream_options"] == {"include_usage": True}
    assert (b"accept-encoding", b"identity") in upstream.headers
    assert rules.stripper is not None and rules.stage is Stage.UPSTREAM


def test_only_an_event_stream_is_stripped(registry: CollectorRegistry) -> None:
    ctx = context(registry)
    for status, content_type, stripped in [
        (200, b"text/event-stream; charset=utf-8", True),
        (200, b"application/json", False),  # a JSON answer to a stream request
        (400, b"text/event-stream", False),  # an error passes whole
    ]:
        rules = rules_for(ctx)
        rules.body(STREAM_BODY)
        rules.admit(2.0)
        head = rules.response_head(
            status, [(b"content-type", content_type), (b"content-length", b"5")], 3.0
        )
        assert (head.stripper is not None) is stripped, (status, content_type)
        # A stripped body's length no longer holds; an event stream is never buffered.
        assert (any(name == b"content-length" for name, _ in head.headers)) is not stripped
        assert head.length
        assert rules.stage is Stage.RESPONDING
        assert ((b"x-accel-buffering", b"no") in head.headers) is content_type.startswith(
            b"text/event-stream"
        )


def test_an_upstreams_own_buffering_header_stands_and_proxy_connection_stops(
    registry: CollectorRegistry,
) -> None:
    """llama-server sends `X-Accel-Buffering: no` itself: the client got it twice (and a
    `yes` would have gone out beside the proxy's `no`). Proxy-Connection is hop-by-hop
    whether or not Connection names it (RFC 9110 §7.6.1)."""
    ctx = context(registry)
    for own in (b"no", b"yes"):
        rules = rules_for(ctx)
        rules.body(STREAM_BODY)
        upstream = rules.admit(2.0)
        head = rules.response_head(
            200,
            [
                (b"content-type", b"text/event-stream"),
                (b"x-accel-buffering", own),
                (b"proxy-connection", b"keep-alive"),
            ],
            3.0,
        )
        assert [v for k, v in head.headers if k == b"x-accel-buffering"] == [own]
        assert not any(k == b"proxy-connection" for k, _ in head.headers)
    sent = rules_for(
        ctx, headers=[(b"content-type", b"application/json"), (b"proxy-connection", b"keep-alive")]
    )
    sent.body(STREAM_BODY)
    upstream = sent.admit(2.0)
    assert not any(k == b"proxy-connection" for k, _ in upstream.headers)


def test_the_clients_address_goes_last_in_x_forwarded_for(registry: CollectorRegistry) -> None:
    """As nginx's $proxy_add_x_forwarded_for: a backend that trusts the proxy for the
    header reads the last address it does not trust, the client the proxy saw, never one
    the client wrote in (vLLM's uvicorn trusts 127.0.0.1: a client could set its own)."""
    ctx = context(registry)
    json_head = [(b"content-type", b"application/json")]
    for sent, expected in [
        ([], b"203.0.113.7"),
        ([(b"x-forwarded-for", b"6.6.6.6")], b"6.6.6.6, 203.0.113.7"),
        (
            [(b"x-forwarded-for", b"1.1.1.1"), (b"x-forwarded-for", b"2.2.2.2, 3.3.3.3")],
            b"1.1.1.1, 2.2.2.2, 3.3.3.3, 203.0.113.7",
        ),
    ]:
        rules = ExchangeRules(
            ctx, "POST", where_to(CHAT, b""), CHAT, json_head + sent, 1.0, 1000.0, "203.0.113.7"
        )
        rules.body(STREAM_BODY)
        upstream = rules.admit(2.0)
        assert [v for k, v in upstream.headers if k == b"x-forwarded-for"] == [expected]
    alone = rules_for(ctx)  # no address known (a socket file): nothing added
    alone.body(STREAM_BODY)
    assert not any(k == b"x-forwarded-for" for k, _ in alone.admit(2.0).headers)


def test_an_early_end_answers_before_the_head_and_drops_after_it(
    registry: CollectorRegistry,
) -> None:
    ctx = context(registry)
    before = rules_for(ctx)
    before.body(STREAM_BODY)
    before.admit(2.0)
    failure = before.early_end(Cause.UPSTREAM_BROKE, ConnectionRefusedError("refused"))
    assert failure.answer is not None and failure.answer[0] == 502
    assert before.exchange is not None and before.exchange.status == 502
    assert before.stage is Stage.DONE

    after = rules_for(ctx)
    after.body(STREAM_BODY)
    after.admit(2.0)
    after.response_head(200, [(b"content-type", b"text/event-stream")], 3.0)
    failure = after.early_end(Cause.IDLE_TIMEOUT)
    assert failure.answer is None and failure.drop
    assert after.exchange is not None and after.exchange.status == 200

    gone = rules_for(ctx)
    gone.body(STREAM_BODY)
    gone.admit(2.0)
    failure = gone.early_end(Cause.CLIENT_GONE)
    assert failure.answer is None and not failure.drop


def test_a_client_gone_before_its_body_was_in_is_counted_once_and_a_refused_one_not(
    registry: CollectorRegistry,
) -> None:
    ctx = context(registry)
    rules = rules_for(ctx)
    rules.abandoned()
    rules.abandoned()
    assert rules.stage is Stage.DONE
    refused = rules_for(ctx, raw_path=b"/../x")
    refused.abandoned()
    assert refused.stage is Stage.REFUSED
    assert requests(registry, "0", "client_cancelled") == 1


def _chunk(choices: str, rest: str = "") -> bytes:
    return b'data: {"id":"c","object":"chat.completion.chunk","choices":[%s]%s}\n\n' % (
        choices.encode(),
        rest.encode(),
    )


HELLO = _chunk('{"index":0,"delta":{"content":"Hello"},"finish_reason":null}')
FINISH = _chunk('{"index":0,"delta":{},"finish_reason":"stop"}')
USAGE = _chunk("", ',"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}')


def test_a_client_gone_while_the_stripper_holds_the_finish_had_no_whole_answer(
    registry: CollectorRegistry,
) -> None:
    """The observer reads what the upstream sent; the client is given it less what the
    usage stripper holds. Gone while it held the finish chunk (waiting for the usage
    chunk), the client never got the finish: cancelled, though the observer saw the stream
    end. Gone once the finish went out, with half of `[DONE]` held (which the observer has
    not read either), it had its whole answer."""
    ctx = context(registry)
    for sent, given in [
        (HELLO + FINISH, HELLO),
        (HELLO + FINISH + USAGE + b"data: [DO", HELLO + FINISH),
    ]:
        rules = rules_for(ctx)
        rules.body(STREAM_BODY)
        rules.admit(2.0)
        head = rules.response_head(200, [(b"content-type", b"text/event-stream")], 3.0)
        assert head.stripper is not None and head.stripper.feed(sent) == given
        assert rules.exchange is not None
        rules.exchange.feed(sent, 3.5)
        rules.exchange.finish_soon(rules.early_end(Cause.CLIENT_GONE))
    finished = {
        error: registry.get_sample_value(
            "tokenprobe_requests_total",
            {
                "model": "other",
                "endpoint": "/v1/chat/completions",
                "code": "200",
                "finish_reason": "stop",
                "error_type": error,
            },
        )
        for error in ("client_cancelled", "none")
    }
    assert finished == {"client_cancelled": 1, "none": 1}
