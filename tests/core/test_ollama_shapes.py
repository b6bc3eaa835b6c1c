"""Ollama's native paths: the proxy's own error bodies there are Ollama's `{"error": "..."}`
(ollama/ollama api/types.go StatusError), and its unmeasured routes are route labels of
their own (server/routes.go GenerateRoutes), bounded: one label for every blob digest."""

from __future__ import annotations

import orjson
import pytest

from proxy.core.errors import error_body, error_shape
from proxy.core.labels import route_template


@pytest.mark.parametrize(
    ("path", "shape"),
    [
        ("/api/chat", "ollama"),
        ("/api/embed", "ollama"),
        ("/api/tags", "ollama"),
        ("/api/blobs/sha256:0123", "ollama"),
        ("/api", "openai"),
        ("/api/chatx", "openai"),  # no route of Ollama's: it answers 404 in plain text
        ("/v1/chat/completions", "openai"),
        ("/v1/messages", "anthropic"),
    ],
)
def test_the_error_shape_follows_the_clients_of_the_path(path: str, shape: str) -> None:
    assert error_shape(path) == shape


def test_ollamas_error_body_is_the_message_under_error() -> None:
    body = error_body(504, "upstream_timeout", "upstream: no answer in 30 s", shape="ollama")
    assert orjson.loads(body) == {"error": "upstream: no answer in 30 s"}


@pytest.mark.parametrize(
    ("path", "want"),
    [
        ("/api/tags", "/api/tags"),
        ("/api/ps", "/api/ps"),
        ("/api/show", "/api/show"),
        ("/api/pull", "/api/pull"),
        ("/api/push", "/api/push"),
        ("/api/create", "/api/create"),
        ("/api/copy", "/api/copy"),
        ("/api/delete", "/api/delete"),
        ("/api/version", "/api/version"),
        ("/api/embeddings", "/api/embeddings"),
        ("/api/chat", "/api/chat"),  # its GET: the POST is measured
        ("/api/blobs/sha256:" + "a" * 64, "/api/blobs/{id}"),
        ("/api/user/keys/c3NoLWVk", "/api/user/keys/{id}"),
        ("/api/nothing", "/other"),
    ],
)
def test_ollamas_native_routes_have_their_own_label(path: str, want: str) -> None:
    assert route_template(path) == want


def test_blob_digests_share_one_label() -> None:
    digests = {route_template(f"/api/blobs/sha256:{i:064x}") for i in range(1000)}
    assert digests == {"/api/blobs/{id}"}
