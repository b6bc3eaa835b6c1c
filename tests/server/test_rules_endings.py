"""How a client's connection ends after an early end, decided once for both data paths.

The rules (proxy/server/rules.py) hand each path a `Failure` whose `ending` says it: the
wire carries it out on its transport, the ASGI relay through its answer's Connection
header, `UpstreamBroke` and the ANSWER_CUT extension. Here the table itself, through the
rules' own events (no socket, no loop); the end-to-end suites (test_exits_inprocess.py,
test_faults.py, test_wire_pipelined_turns.py, hostile/test_client.py) check that both
paths carry it out alike.
"""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import CollectorRegistry

from proxy.core.errors import Cause, Ending
from proxy.server.rules import ExchangeRules
from tests.server.conftest import no_proxy
from tests.server.test_exchange_rules import STREAM_BODY, context, rules_for

pytestmark = no_proxy

_EVENT_STREAM = [(b"content-type", b"text/event-stream")]

#: (cause, the response head went out, what the upstream client raised) -> the ending.
#: Causes that come only on one side of the head (a first-byte timeout before it; the
#: upstream's or the client's silence mid-body after it) appear only there.
TABLE: list[tuple[Cause, bool, BaseException | None, Ending]] = [
    (Cause.CLIENT_GONE, False, None, Ending.GONE),
    (Cause.CLIENT_GONE, True, None, Ending.GONE),
    (Cause.FIRST_BYTE_TIMEOUT, False, None, Ending.KEEP),
    (Cause.UPSTREAM_BROKE, False, httpx.ConnectError("refused"), Ending.KEEP),
    (Cause.UPSTREAM_BROKE, False, httpx.ReadTimeout("read"), Ending.KEEP),
    (Cause.UPSTREAM_BROKE, True, httpx.ReadError("reset"), Ending.CUT),
    (Cause.UPSTREAM_BROKE, True, httpx.ReadTimeout("read"), Ending.CUT),
    (Cause.IDLE_TIMEOUT, True, None, Ending.CUT),
    (Cause.CLIENT_STALLED, True, None, Ending.ABORT),
    (Cause.SHUTDOWN, False, None, Ending.CLOSE),
    (Cause.SHUTDOWN, True, None, Ending.DROP),
]


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def admitted(registry: CollectorRegistry, *, head_out: bool) -> ExchangeRules:
    rules = rules_for(context(registry))
    rules.body(STREAM_BODY)
    rules.admit(2.0)
    if head_out:
        rules.response_head(200, list(_EVENT_STREAM), 3.0)
    return rules


def test_the_table_names_every_cause() -> None:
    assert {cause for cause, *_ in TABLE} == set(Cause)


@pytest.mark.parametrize(
    ("cause", "head_out", "exc", "ending"),
    TABLE,
    ids=[f"{c.value}-{'after' if h else 'before'}-{type(e).__name__}" for c, h, e, _ in TABLE],
)
def test_each_early_end_says_how_the_connection_ends(
    registry: CollectorRegistry,
    cause: Cause,
    head_out: bool,
    exc: BaseException | None,
    ending: Ending,
) -> None:
    failure = admitted(registry, head_out=head_out).early_end(cause, exc)
    assert failure.ending is ending
    # An answer exactly where the connection is kept or closed after one: before the head,
    # and never to a client that left.
    assert (failure.answer is not None) == (ending in (Ending.KEEP, Ending.CLOSE))
    assert failure.closes is (ending is not Ending.KEEP)
    assert failure.drop is (ending in (Ending.DROP, Ending.CUT, Ending.ABORT))


def test_the_drains_503_to_a_body_still_coming_in_closes_the_connection(
    registry: CollectorRegistry,
) -> None:
    failure = rules_for(context(registry)).shut_out()
    assert failure.answer is not None and failure.answer[:2] == (503, "proxy_shutting_down")
    assert failure.ending is Ending.CLOSE and failure.closes and not failure.drop
