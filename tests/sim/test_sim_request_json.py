"""The simulator reads a request body as vLLM 0.32 does (proxy/sim/request_json.py).

vLLM reads bodies with starlette's `json.loads(body)` (starlette/requests.py
`Request.json`, called by fastapi/routing.py and serve/sagemaker/api_router.py), which
takes a UTF-8 BOM, UTF-16 and UTF-32, NaN and Infinity. Each body below was served with a
200 by the real vLLM 0.32 (the CPU build, tests/vllm/conftest.py's model), where the
simulator answered 400 "JSON decode error".
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator

import httpx
import pytest

from proxy.sim import SimConfig
from proxy.sim.request_json import read_json
from tests.sim.test_sim_support import running

COMPLETION = {"model": "sim-model", "prompt": "hi", "max_tokens": 2}
TEXT = json.dumps(COMPLETION)
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

#: Bodies json.loads reads and orjson refuses.
LENIENT = {
    "utf8-bom": codecs.BOM_UTF8 + TEXT.encode(),
    "utf16-le": TEXT.encode("utf-16-le"),
    "utf16-bom": TEXT.encode("utf-16"),
    "utf32-be": TEXT.encode("utf-32-be"),
    "nan": TEXT.replace("}", ', "user_field": NaN}').encode(),
    "infinity": TEXT.replace("}", ', "user_field": -Infinity}').encode(),
}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with running(SimConfig(models=("sim-model",), ttft=0, output_tokens=2)) as (server, _):
        yield server.url


@pytest.mark.parametrize("path", ["/v1/completions", "/invocations"])
@pytest.mark.parametrize("body", LENIENT.values(), ids=LENIENT.keys())
def test_a_body_json_loads_reads_is_served(url: str, path: str, body: bytes) -> None:
    reply = httpx.post(url + path, content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["object"] == "text_completion"


def test_a_chat_with_a_bom_is_served(url: str) -> None:
    body = codecs.BOM_UTF8 + json.dumps(CHAT).encode()
    reply = httpx.post(url + "/v1/chat/completions", content=body)
    assert reply.status_code == 200 and reply.json()["object"] == "chat.completion"


def test_a_body_no_reader_takes_is_still_a_400(url: str) -> None:
    reply = httpx.post(url + "/v1/completions", content=b'{"prompt": "hi",}')
    assert reply.status_code == 400
    assert reply.json()["error"]["message"].startswith("JSON decode error")


@pytest.mark.parametrize("body", LENIENT.values(), ids=LENIENT.keys())
def test_read_json_gives_what_json_loads_gives(body: bytes) -> None:
    parsed, why = read_json(body)
    assert why is None
    assert json.dumps(parsed) == json.dumps(json.loads(body))  # as text: NaN != NaN


def test_read_json_keeps_nan_and_makes_lone_surrogates_writable() -> None:
    parsed, why = read_json(b'{"a": NaN, "b": "x\\ud800"}')
    assert why is None and parsed is not None
    assert parsed["a"] != parsed["a"] and parsed["b"] == "x\ufffd"
