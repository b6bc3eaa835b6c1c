"""Settings groups are built one way (proxy.settings.group): a field named like a setting
takes its value, the rest are derived by name, and nothing is copied by hand."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from proxy.server.admission import RelaySettings, relay_settings
from proxy.server.assemble import assemble
from proxy.server.protocol import HEAD_SLACK, HeadLimits
from proxy.server.tunnel import TunnelContext, tunnel_context
from proxy.settings import NAMES, Settings, group, parse
from tests.server.conftest import no_proxy

pytestmark = no_proxy

#: Each group, how the proxy builds it, and the fields it derives instead of copying.
GROUPS: list[tuple[type[Any], Callable[[Settings], Any], set[str]]] = [
    (RelaySettings, relay_settings, {"secret_headers", "upstream_ssl"}),
    (HeadLimits, HeadLimits.from_settings, {"max_head_bytes"}),
    (
        TunnelContext,
        lambda settings: tunnel_context(settings, SINKS),
        {"upstream", "ssl", "idle_timeout", "max_message_bytes", "sinks", "secret_headers"},
    ),
]

SETTINGS = parse(
    [
        "--upstream",
        "http://127.0.0.1:9/base",
        "--max-body-bytes",
        "1234",
        "--max-header-bytes",
        "2345",
        "--max-headers",
        "17",
        "--header-timeout",
        "3.5",
        "--idle-timeout",
        "7",
        "--first-byte-timeout",
        "8",
        "--body-timeout",
        "9",
        "--no-inject-usage",
        "--secret-header",
        "X-Key",
    ],
    {},
)
SINKS = assemble(SETTINGS, {}, registry=CollectorRegistry()).sinks


@pytest.mark.parametrize(
    ("cls", "build", "derived"), GROUPS, ids=lambda g: getattr(g, "__name__", "")
)
def test_every_field_of_a_group_is_a_setting_or_derived(
    cls: type[Any], build: Callable[[Settings], Any], derived: set[str]
) -> None:
    required = {
        f.name
        for f in dataclasses.fields(cls)
        if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    assert derived <= required
    assert required - derived <= NAMES, required - derived - NAMES
    built = build(SETTINGS)
    for name in required - derived:
        assert getattr(built, name) == getattr(SETTINGS, name), name


def test_the_derived_fields_are_computed_from_the_settings() -> None:
    relay = relay_settings(SETTINGS)
    assert b"x-key" in relay.secret_headers and b"authorization" in relay.secret_headers
    assert tunnel_context(SETTINGS, SINKS).secret_headers == relay.secret_headers
    assert (relay.upstream, relay.inject_usage) == ("http://127.0.0.1:9/base", False)
    limits = HeadLimits.from_settings(SETTINGS)
    assert limits == HeadLimits(2345 + HEAD_SLACK, 17, 3.5, 9.0)


def test_a_group_refuses_a_field_it_cannot_fill_and_a_derived_name_it_has_not() -> None:
    @dataclasses.dataclass
    class Unfillable:
        idle_timeout: float
        not_a_setting: int

    with pytest.raises(TypeError):
        group(Unfillable, SETTINGS)

    @dataclasses.dataclass
    class Small:
        idle_timeout: float

    assert group(Small, SETTINGS) == Small(7.0)
    with pytest.raises(TypeError, match="no fields"):
        group(Small, SETTINGS, typo=1)
