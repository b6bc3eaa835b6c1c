"""--root-path: vLLM started with `--root-path /tenant-a` serves every route under it as
well as at the root (FastAPI puts the root path in the scope; Starlette's `get_route_path`
takes it off before matching). The proxy measures a request under it as the path after
it, labels and keys it by that path, and forwards it as sent; its own routes stay at the
root. Without the setting, `/tenant-a/v1/chat/completions` was served but unmeasured:
passthrough `/other`, no record, no usage asked.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator

import httpx
import orjson
import pytest

from proxy.core.paths import root_path, under_root
from proxy.settings import SettingsError, resolve
from tests.conftest import MODEL, ProxyUnderTest
from tests.hostile.client import Switcher, whole, ws_head
from tests.hostile.peers import SSE_BODY, Conn, RawUpstream, Request, by_target, exchange
from tests.hostile.peers import raw_upstream as started_upstream
from tests.scrape import Scrape, wait_for
from tests.server.conftest import no_proxy, paths
from tests.server.test_backend_identity import backend_info

ROOT = "/tenant-a"
CHAT = "/v1/chat/completions"
PASSTHROUGH = "tokenprobe_passthrough_requests_total"
STREAM = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n"
    % len(SSE_BODY)
) + SSE_BODY
STREAMED = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}


async def _version(conn: Conn, request: Request) -> None:
    """vLLM's GET /version: the proxy's question that names the backend (identity.py)."""
    body = b'{"version":"0.32.0"}'
    conn.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
    await conn.drain()


@pytest.fixture
def upstream() -> Iterator[RawUpstream]:
    """A vLLM stand-in: a chat stream for every request, its version at /version."""
    with started_upstream(default=by_target({b"/version": _version}, STREAM)) as server:
        yield server


def _post(proxy: ProxyUnderTest, path: str, **headers: str) -> httpx.Response:
    return httpx.post(proxy.url + path, json=STREAMED, headers=headers, timeout=30)


def test_a_request_under_the_root_path_is_measured_as_the_path_after_it_and_forwarded_as_sent(
    upstream: RawUpstream, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    proxy = start_proxy(upstream.url, root_path=ROOT)
    assert _post(proxy, ROOT + CHAT).status_code == 200
    assert _post(proxy, CHAT).status_code == 200  # the backend serves it at the root too
    records = proxy.wait_records(2, timeout=30)
    assert [r.endpoint for r in records] == [CHAT, CHAT]
    assert all(r.finish_reason == "stop" for r in records)
    asked = [r for r in upstream.requests if r.line.startswith(b"POST")]
    assert [r.target for r in asked] == [(ROOT + CHAT).encode(), CHAT.encode()]
    for request in asked:  # measured: the proxy asked for the usage the client did not
        assert orjson.loads(request.body)["stream_options"] == {"include_usage": True}


def test_the_proxys_own_answer_under_it_takes_its_apis_error_shape(
    upstream: RawUpstream, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """A body over --max-body-bytes to `/tenant-a/v1/messages` gets the Messages API's
    error shape (`{"type": "error", ...}`), as `/v1/messages` does: the shape is chosen by
    the route after the root path, not the OpenAI shape of a path no API has."""
    proxy = start_proxy(upstream.url, root_path=ROOT, max_body_bytes=64)
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 200}]}
    for path in ("/v1/messages", ROOT + "/v1/messages"):
        reply = httpx.post(proxy.url + path, json=body, timeout=30)
        assert reply.status_code == 413, path
        assert reply.json()["type"] == "error" and "64" in reply.json()["error"]["message"], path


@pytest.mark.parametrize("path", [ROOT + "b" + CHAT, ROOT, "/other" + ROOT + CHAT])
def test_only_a_path_that_starts_with_it_at_a_segments_end_is_under_it(
    upstream: RawUpstream, start_proxy: Callable[..., ProxyUnderTest], path: str
) -> None:
    """Starlette takes the root path off only where a `/` follows it: vLLM answers these
    404, and the proxy measures none of them."""
    proxy = start_proxy(upstream.url, root_path=ROOT)
    assert _post(proxy, path).status_code == 200  # the stand-in answers everything
    page = wait_for(proxy.url, PASSTHROUGH, 1)
    assert page.total(PASSTHROUGH, route="/other") == 1 and proxy.records == []


def test_an_unmeasured_request_under_it_is_labelled_by_the_route_after_it(
    upstream: RawUpstream, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    proxy = start_proxy(upstream.url, root_path=ROOT)
    assert httpx.get(proxy.url + ROOT + "/v1/models", timeout=30).status_code == 200
    page = wait_for(proxy.url, PASSTHROUGH, 1)
    assert page.total(PASSTHROUGH, route="/v1/models") == 1
    assert upstream.requests[-1].target == (ROOT + "/v1/models").encode()


def test_the_proxys_own_routes_stay_at_the_root(
    upstream: RawUpstream, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """`/tenant-a/metrics` is the backend's (vLLM serves its exposition there too), as
    every path under the root path is: only `/metrics` itself is the proxy's."""
    proxy = start_proxy(upstream.url, root_path=ROOT)
    assert b"tokenprobe_" in httpx.get(proxy.url + "/metrics", timeout=30).content
    assert httpx.get(proxy.url + ROOT + "/metrics", timeout=30).content == SSE_BODY
    assert [r.target for r in upstream.requests] == [(ROOT + "/metrics").encode()]


def test_a_key_under_it_is_checked_by_vllm_so_its_answer_admits_the_key(
    upstream: RawUpstream, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """vLLM's API-key middleware takes the root path off the path before it looks for
    its guarded prefixes (`scope["path"].removeprefix(root_path)`,
    vllm/entrypoints/serve/middleware/authenticate.py): a key that a request under it
    got an answer with is one vLLM accepted, so it takes a label of its own
    (proxy/sinks/keys.py `checks_keys`), not `other`."""
    proxy = start_proxy(upstream.url, root_path=ROOT, key_label="hash", key_salt="s", models_refresh=0.2)  # fmt: skip
    assert backend_info(proxy, "vllm", "0.32.0") == 1
    assert _post(proxy, ROOT + CHAT, authorization="Bearer good").status_code == 200
    proxy.wait_records(1, timeout=30)
    page = Scrape.parse(httpx.get(proxy.url + "/metrics", timeout=30).text)
    keys = {s.labels["key"] for s in page.series("tokenprobe_key_requests_total")}
    assert keys == {hashlib.sha256(b"sgood").hexdigest()[:12]}


@paths("wire", why="only the wire tunnels WebSockets (the ASGI relay refuses the upgrade)")
def test_a_websocket_under_it_is_measured_as_the_route_after_it(
    upstream: RawUpstream, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """vLLM's /v1/realtime goes through the same root path: the tunnel counts the
    session on the realtime route, not `/other`."""
    upstream.default = Switcher(delay=0.0).script()
    proxy = start_proxy(upstream.url, root_path=ROOT)
    handshake = ws_head((ROOT + "/v1/realtime").encode())
    got = exchange(proxy.url, handshake, idle=0.5, done=whole())
    assert got.startswith(b"HTTP/1.1 101"), got
    assert upstream.requests[-1].target == (ROOT + "/v1/realtime").encode()
    page = wait_for(proxy.url, "tokenprobe_websocket_sessions_total", 1)
    assert page.total("tokenprobe_websocket_sessions_total", route="/v1/realtime") == 1


@no_proxy
@pytest.mark.parametrize(
    ("path", "route"),
    [
        ("/tenant-a/v1/chat/completions", "/v1/chat/completions"),
        ("/tenant-a/", "/"),
        ("/tenant-a", "/tenant-a"),  # vLLM: "" matches no route, a 404
        ("/tenant-ab/v1/models", "/tenant-ab/v1/models"),
        ("/v1/models", "/v1/models"),
        ("/x/tenant-a/v1/models", "/x/tenant-a/v1/models"),
    ],
)
def test_the_route_under_a_root_path_is_starlettes(path: str, route: str) -> None:
    assert under_root(path, "/tenant-a") == route
    assert under_root(path, None) == path


@no_proxy
@pytest.mark.parametrize(
    ("given", "kept"),
    [("/tenant-a", "/tenant-a"), ("/tenant%2da", "/tenant-a"), ("/a/b c", "/a/b%20c")],
)
def test_a_root_path_is_kept_in_the_form_paths_are_compared_in(given: str, kept: str) -> None:
    assert root_path(given) == kept


@no_proxy
@pytest.mark.parametrize(
    "given", ["tenant-a", "/", "/tenant-a/", "/t?x=1", "/t#f", "/t/../x", "/t%2Fx", ""]
)
def test_a_root_path_that_cannot_be_one_is_refused(given: str) -> None:
    with pytest.raises(ValueError):
        root_path(given)


@no_proxy
def test_the_setting_is_read_from_its_flag_and_variable_and_refused_with_their_name() -> None:
    assert resolve({"upstream": "http://x", "root_path": "/tenant-a"}, {}).root_path == ROOT
    env = {"TOKENPROBE_ROOT_PATH": "/tenant-a"}
    assert resolve({"upstream": "http://x"}, env).root_path == ROOT
    assert resolve({"upstream": "http://x"}, {}).root_path is None
    with pytest.raises(SettingsError, match="--root-path='/tenant-a/': no trailing slash"):
        resolve({"upstream": "http://x", "root_path": "/tenant-a/"}, {})
