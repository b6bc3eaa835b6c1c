"""An operator's data file (prices, SLOs): JSON when its name ends in .json, else YAML.

PyYAML is imported only when a YAML file is read: importing it took 35 ms of every
process's start (`python -X importtime -c "import proxy.server.serve"`), and most
processes read no such file.
"""

from __future__ import annotations

import json
from typing import Any


def parse_data_file(text: str, name: str) -> Any:
    """The parsed document; ValueError (with the parser's words) when it is not valid."""
    if name.endswith(".json"):
        return json.loads(text)  # json.JSONDecodeError is a ValueError
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(str(exc)) from None
