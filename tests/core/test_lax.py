"""proxy/core/lax.py reads a request's fields as pydantic's lax mode does (vLLM validates its
requests so): checked against pydantic itself, on chosen values and on generated ones."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from proxy.core.apis import api_for
from proxy.core.lax import lax_bool, lax_float, lax_int


class _Fields(BaseModel):  # as vLLM's OpenAIBaseModel: pydantic's defaults, lax
    flag: bool | None = None
    count: int | None = None
    number: float | None = None


def _pydantic(field: str, value: Any) -> Any:
    try:
        return getattr(_Fields(**{field: value}), field)
    except ValidationError:
        return None


# The last seven were found by Hypothesis and review: pydantic-core's own rules for `_`,
# digits and whitespace.
CHOSEN = [True, False, 0, 1, 2, -1, 0.0, 1.0, 2.0, 2.5, float("inf"), float("nan"), "1", "0",
          "true", "TRUE", "On", "off", "yes", "n", " true", "maybe", "", "2", " 2 ", "+2",
          "-3", "2.0", "2.", "2.00", "1e1", "2_0", "2_", "_2", "0x2", None, [], {},
          "0_.", "1_.5", "in_f", " 1_0", "١٢", "1.5\xa0", "\u20031.5"]  # fmt: skip
TEXTS = st.text(alphabet="0123456789+-_. eEtrufalsyonTRUEFALSEi١", max_size=6)
VALUES = st.one_of(st.booleans(), st.integers(), st.floats(), TEXTS, st.sampled_from(CHOSEN))


def test_chosen_values_are_read_as_pydantic_reads_them() -> None:
    for value in CHOSEN:
        if value is not None:
            assert lax_bool(value) == _pydantic("flag", value), value
            assert lax_int(value) == _pydantic("count", value), value
            assert _same(lax_float(value), _pydantic("number", value)), value


@given(VALUES)
def test_generated_values_are_read_as_pydantic_reads_them(value: Any) -> None:
    assert lax_bool(value) == _pydantic("flag", value)
    assert lax_int(value) == _pydantic("count", value)
    assert _same(lax_float(value), _pydantic("number", value))


def _same(a: float | None, b: float | None) -> bool:
    return a == b or (a is not None and b is not None and a != a and b != b)  # nan is nan


def test_the_fields_that_change_what_the_proxy_asks_for_are_read_laxly() -> None:
    """`"stream": "true"` streams, `include_usage: 1` asks for usage itself, `"n": "2"` is two
    choices (the proxy then asks for no usage), and `"echo": "yes"` echoes."""
    chat, completions = api_for("/v1/chat/completions"), api_for("/v1/completions")
    assert chat is not None and completions is not None
    body = {"model": "m", "stream": "true", "messages": []}
    assert chat.read_request(body).stream is True
    assert chat.read_request({**body, "stream": "off"}).stream is False
    for asked in (1, "true", "Yes"):
        assert chat.read_request(
            {**body, "stream_options": {"include_usage": asked}}
        ).usage_requested
    assert not chat.read_request(
        {**body, "stream_options": {"include_usage": "false"}}
    ).usage_requested
    for n in ("2", 2.0, " 3 "):
        asks = {**body, "n": n}
        assert chat.ask_for_usage(asks, orjson.dumps(asks)) is None, n
    one = {**body, "n": "1"}
    assert chat.ask_for_usage(one, orjson.dumps(one)) is not None
    prompt = {"model": "m", "prompt": "a", "echo": "yes", "n": "2"}
    assert completions.read_request(prompt).echoed == ("a", "a")
