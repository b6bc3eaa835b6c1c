"""The simulator's --api-key, read as vLLM 0.32 reads it.

vllm/entrypoints/serve/middleware/authenticate.py (AuthenticationMiddleware.verify_token):
the first Authorization header, split at its first space, the scheme "bearer" in any case,
the rest one of the keys exactly; OPTIONS is never guarded. register.py
(init_entrypoints_middleware): the keys are --api-key's values (nargs "+"), empty ones
dropped (vLLM falls back to VLLM_API_KEY; the simulator does not, so a shell set up for a
real vLLM does not lock its tests out). Each row of `HEADERS` was sent, byte for byte, to a vLLM
0.32 started with `--api-key sekret` under uvicorn, and answered the status given."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from proxy.sim import SimApp, SimConfig
from proxy.sim.cli import parse
from tests.servers import ThreadedServer, free_port, spawn, stop, wait_http
from tests.sim.test_sim_support import running


@pytest.fixture(scope="module")
def sim() -> Iterator[tuple[ThreadedServer, SimApp]]:
    with running(SimConfig(api_key="sekret", ttft=0)) as started:
        yield started


def status(url: str, head: list[bytes], method: bytes = b"GET") -> int:
    """The status a GET /v1/models with exactly these header lines gets: raw bytes, as
    httpx would neither send two spaces nor two Authorization headers as written."""
    where = urlsplit(url)
    with socket.create_connection((where.hostname, where.port), timeout=10) as conn:
        lines = [method + b" /v1/models HTTP/1.1", b"Host: sim", b"Connection: close", *head]
        conn.sendall(b"\r\n".join(lines) + b"\r\n\r\n")
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    return int(answer.split(b" ", 2)[1])


HEADERS = {
    "exact": ([b"Authorization: Bearer sekret"], 200),
    "the scheme lower case": ([b"Authorization: bearer sekret"], 200),
    "the scheme upper case": ([b"Authorization: BEARER sekret"], 200),
    "the scheme mixed case": ([b"Authorization: BeArEr sekret"], 200),
    "the header name lower case": ([b"authorization: Bearer sekret"], 200),
    "spaces around the value (the parser drops them)": ([b"Authorization:   Bearer sekret "], 200),
    "two spaces after the scheme": ([b"Authorization: Bearer  sekret"], 401),
    "a tab after the scheme": ([b"Authorization: Bearer\tsekret"], 401),
    "no scheme": ([b"Authorization: sekret"], 401),
    "the scheme alone": ([b"Authorization: Bearer"], 401),
    "the scheme and a space": ([b"Authorization: Bearer "], 401),
    "another scheme": ([b"Authorization: Basic sekret"], 401),
    "the key and more": ([b"Authorization: Bearer sekret extra"], 401),
    "the right key first of two headers": (
        [b"Authorization: Bearer sekret", b"Authorization: Bearer wrong"],
        200,
    ),
    "the right key second of two headers": (
        [b"Authorization: Bearer wrong", b"Authorization: Bearer sekret"],
        401,
    ),
    "no header": ([], 401),
    "x-api-key": ([b"x-api-key: sekret"], 401),
}


@pytest.mark.parametrize(("head", "expected"), HEADERS.values(), ids=HEADERS.keys())
def test_the_authorization_header_is_read_as_vllm_reads_it(
    url: str, head: list[bytes], expected: int
) -> None:
    assert status(url, head) == expected


def test_any_of_several_keys_opens() -> None:
    with running(SimConfig(api_key=("sekret", "second"), ttft=0)) as (server, _):
        for key in (b"sekret", b"second"):
            assert status(server.url, [b"Authorization: Bearer " + key]) == 200, key
        assert status(server.url, [b"Authorization: Bearer other"]) == 401
        assert status(server.url, [b"Authorization: Bearer sekret second"]) == 401  # one key


def test_options_is_never_guarded(url: str) -> None:
    # No route answers OPTIONS: vLLM 0.32 answered 405 {"detail":"Method Not Allowed"}.
    assert status(url, [], method=b"OPTIONS") == 405


@pytest.mark.parametrize(
    ("argv", "environ", "keys"),
    [
        (["--api-key", "a", "b"], {}, ("a", "b")),
        (["--api-key", "a", "--api-key", "b"], {}, ("b",)),  # argparse's store: the last
        ([], {"VLLM_API_KEY": "v"}, None),  # not read: a shell set up for vLLM's own
        ([], {"TOKENPROBE_SIM_API_KEY": "t"}, ("t",)),
        (["--api-key", "a"], {"TOKENPROBE_SIM_API_KEY": "t"}, ("a",)),  # the flag wins
        (["--api-key", ""], {}, None),  # given, empty: no key at all
        ([], {}, None),
    ],
)
def test_the_keys_come_from_the_flag_else_the_simulators_variable(
    argv: list[str], environ: dict[str, str], keys: tuple[str, ...] | None
) -> None:
    config, _ = parse(argv, environ)
    assert config.api_key == keys


def test_tokenprobe_sim_takes_several_keys_and_not_vllms_variable() -> None:
    """The command itself: `--api-key a b` opens with either key, VLLM_API_KEY unread."""
    port = free_port()
    sim = spawn("sim", "--port", str(port), "--api-key", "a", "b", env={"VLLM_API_KEY": "v"})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health")
        for header, expected in (
            (b"Authorization: Bearer a", 200),
            (b"Authorization: bearer b", 200),
            (b"Authorization: Bearer v", 401),
        ):
            assert status(url, [header]) == expected, header
    finally:
        stop(sim)
