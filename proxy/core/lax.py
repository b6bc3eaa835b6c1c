"""Request fields read as vLLM reads them: pydantic's lax mode, in which its request models
(OpenAIBaseModel) validate a client's JSON. A client may send `"stream": "true"`,
`"include_usage": 1` or `"n": "2"`, and vLLM honours each; the proxy, which decides from
these fields what to ask for and what to give back, must read them the same way.

Checked against pydantic 2.14 as vLLM 0.32 installs it: a bool field takes a bool, 0 or 1
as an int or a float, or one of the words below in any case (no surrounding blanks); an
int field takes an int, a bool, a whole float within 64 bits, or a string of digits (a sign,
`_` between digits, blanks around, a fraction of zeros); anything else is refused (422).
"""

from __future__ import annotations

import re
from typing import Any

_TRUE_WORDS = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE_WORDS = frozenset({"0", "off", "f", "false", "n", "no"})
_INT_TEXT = re.compile(r"\s*[+-]?[0-9][0-9_]*(?:\.0+)?\s*")


def lax_bool(value: Any) -> bool | None:
    """`value` as pydantic reads a bool field, None where it refuses it."""
    if type(value) is bool:
        return value
    if type(value) in (int, float) and value in (0, 1):
        return bool(value)
    if type(value) is str:
        word = value.lower()
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS:
            return False
    return None


def lax_float(value: Any) -> float | None:
    """`value` as pydantic reads a float field (a bool, a number, a numeric text as Python's
    float() reads it), None where it refuses it."""
    if type(value) in (bool, int, float):
        return float(value)
    if type(value) is str:
        if not value.strip().isascii():  # Python reads "١٢" as 12; pydantic-core ASCII only
            return None
        if "_" in value:
            # pydantic-core's rule, not Python's: `_`s anywhere but first, last or doubled
            # ("0_.", "1_.5", "in_f" are numbers), and then no whitespace around the text
            if value[0] == "_" or value[-1] == "_" or "__" in value or value != value.strip():
                return None
            value = value.replace("_", "")
        try:
            return float(value)
        except ValueError:
            return None
    return None


def lax_int(value: Any) -> int | None:
    """`value` as pydantic reads an int field, None where it refuses it."""
    if type(value) is int:
        return value
    if type(value) is bool:
        return int(value)
    if type(value) is float:  # whole, and within a 64-bit int (is_integer: not inf or nan)
        return int(value) if value.is_integer() and -(2**63) <= value < 2**63 else None
    if type(value) is str and _INT_TEXT.fullmatch(value):
        try:
            return int(value.strip().split(".")[0])  # int() takes the sign and the `_`s
        except ValueError:  # `_` not between digits
            return None
    return None
