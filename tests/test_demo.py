"""`tokenprobe demo`, the README's first command, on a machine where its port is taken."""

from __future__ import annotations

import socket

import pytest

from proxy.demo import SCENARIOS, main


def test_a_port_in_use_is_one_line_naming_the_way_out(capsys: pytest.CaptureFixture[str]) -> None:
    """Something already listens on the demo's port: one line saying to pass --port, exit 2
    (it was uvicorn's bind error and a traceback, exit 3)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err == f"tokenprobe demo: port {port} is in use; pass --port N (0: any free port)\n"


def test_every_row_name_fits_its_column() -> None:
    """The table's first column is 24 wide and cuts a longer name ("ollama chat, model
    not l" was printed): each scenario's name is whole."""
    assert [s.name for s in SCENARIOS if len(s.name) > 24] == []
