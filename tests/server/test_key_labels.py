"""`--key-label hash`: a key takes one of the MAX_KEYS places only once the backend
accepted it. Anyone who reaches the port can make up keys: when every made-up key took a
place, 100 refused requests left every real key `other` until the next start."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import httpx

from proxy.core.measurement import ErrorType, Measurement, TokenSource
from proxy.server.ledger import FileLedger, ledger_path
from proxy.sim.utility import VLLM_VERSION
from proxy.sinks.keys import MAX_KEYS, KeyLabels, checks_keys
from tests.conftest import MODEL, ProxyUnderTest, Running
from tests.factories import measurement
from tests.scrape import Scrape
from tests.server.conftest import no_proxy, paths
from tests.server.test_backend_identity import backend_info

CHAT = "/v1/chat/completions"
ANSWERED = measurement()
REFUSED = measurement(status_code=401, error_type=ErrorType.AUTH, token_source=TokenSource.NONE)
UNANSWERED = measurement(status_code=502, ttfb=None, error_type=ErrorType.UPSTREAM_UNREACHABLE)
TURN = measurement(endpoint="/v1/realtime", status_code=101, ttfb=None)  # a WebSocket turn


def bearer(token: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {token}".encode())]


def label(keys: KeyLabels, token: str, m: Measurement) -> str:
    """What a request with `token` that ended as `m` is recorded with."""
    return keys.settle(keys(bearer(token)), m)


def test_keys_the_backend_refused_take_no_place_from_a_real_one(
    start_sim: Callable[..., Running], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    sim = start_sim(api_key="good", ttft=0.0, output_tokens=2)
    proxy = start_proxy(sim.url, key_label="hash", key_salt="s")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        for i in range(MAX_KEYS + 5):
            assert client.post(CHAT, json=body, headers=dict(bearer(f"junk{i}"))).status_code == 401
        assert client.post(CHAT, json=body, headers={"authorization": "Bearer good"}).is_success
        proxy.wait_records(MAX_KEYS + 6)
        page = Scrape.parse(client.get("/metrics").text)
    counts = {
        (s.labels["key"], s.labels["error_type"]): s.value
        for s in page.series("tokenprobe_key_requests_total")
    }
    good = hashlib.sha256(b"sgood").hexdigest()[:12]
    assert counts == {("rejected", "auth"): MAX_KEYS + 5, (good, "none"): 1.0}


def test_keys_on_routes_vllm_does_not_check_take_no_place_from_a_real_one(
    start_sim: Callable[..., Running], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """vLLM checks keys only under its guarded prefixes (`/v1`, `/v2`, `/inference`,
    `/cohere`): its `/score` answers a made-up key as any other, so that answer vouches for
    nothing. 100 such requests took every place, and the real key was `other`."""
    sim = start_sim(api_key="good", ttft=0.0, output_tokens=2)
    proxy = start_proxy(sim.url, key_label="hash", key_salt="s", models_refresh=0.2)
    assert backend_info(proxy, "vllm", VLLM_VERSION) == 1
    score = {"model": MODEL, "text_1": "a", "text_2": "b"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        for i in range(MAX_KEYS + 5):
            answered = client.post("/score", json=score, headers=dict(bearer(f"junk{i}")))
            assert answered.status_code != 401  # not checked: answered as the backend does
        assert client.post(CHAT, json=body, headers={"authorization": "Bearer good"}).is_success
        proxy.wait_records(MAX_KEYS + 6)
        page = Scrape.parse(client.get("/metrics").text)
    keys = {s.labels["key"] for s in page.series("tokenprobe_key_requests_total")}
    assert keys == {"other", hashlib.sha256(b"sgood").hexdigest()[:12]}


def test_only_vllms_guarded_prefixes_check_keys() -> None:
    assert checks_keys("vllm", "/v1/chat/completions")
    assert checks_keys("vllm", "/inference/v1/generate")
    assert not checks_keys("vllm", "/score")
    assert not checks_keys("vllm", "/pooling")
    assert checks_keys("llamacpp", "/completion")  # llama-server checks all but its public
    assert checks_keys("unknown", "/score")  # not known: as before, the answer vouches


def test_a_new_key_where_none_is_checked_is_other_and_admits_nothing() -> None:
    keys = KeyLabels("s", max_keys=2)
    assert keys(bearer("junk"), False) == "other"
    assert keys.settle(keys(bearer("junk"), False), ANSWERED) == "other"
    first = label(keys, "a", ANSWERED)  # checked routes still admit: both places free
    assert label(keys, "b", ANSWERED) not in ("other", first)
    assert keys(bearer("a"), False) == first  # an admitted key keeps its label anywhere


@paths("wire", why="the wire tunnels WebSockets; the ASGI app refuses them")
def test_a_realtime_sessions_turns_carry_its_keys_own_label(
    start_sim: Callable[..., Running], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """The tunnel resolves its key when the upgrade arrives and records each turn later:
    the first turn admits the key, as an HTTP request's answer does."""
    import base64

    from websockets.sync.client import connect

    sim = start_sim(ttft=0.0, output_tokens=2)
    proxy = start_proxy(sim.url, key_label="hash", key_salt="s")
    url = proxy.url.replace("http://", "ws://") + "/v1/realtime"
    audio = base64.b64encode(b"\0\0" * 1600).decode()
    with connect(url, additional_headers={"authorization": "Bearer sk-ws"}) as ws:
        ws.recv(timeout=10)  # session.created
        ws.send(f'{{"type":"session.update","model":"{MODEL}"}}')
        ws.send(f'{{"type":"input_audio_buffer.append","audio":"{audio}"}}')
        ws.send('{"type":"input_audio_buffer.commit"}')  # as vLLM's client: commit, then final
        ws.send('{"type":"input_audio_buffer.commit","final":true}')
        while '"transcription.done"' not in ws.recv(timeout=10):
            pass
    proxy.wait_records(1)
    own = hashlib.sha256(b"ssk-ws").hexdigest()[:12]
    assert proxy.sample("tokenprobe_key_requests_total", key=own, model=MODEL, error_type="none")


@no_proxy
def test_a_refused_key_is_rejected_and_admits_nothing() -> None:
    keys = KeyLabels("salt", max_keys=2)
    assert {label(keys, f"junk{i}", REFUSED) for i in range(10)} == {"rejected"}
    first, second = label(keys, "a", ANSWERED), label(keys, "b", ANSWERED)
    assert len({first, second, "rejected", "other", "none"}) == 5  # their own two places
    assert label(keys, "c", ANSWERED) == "other"  # the places are taken, by real keys


@no_proxy
def test_only_an_answer_vouches_for_a_key() -> None:
    """No answer (unreachable, timed out, the client gone first) says nothing of the key:
    `other`, and no place taken; its first answered request admits it."""
    keys = KeyLabels("salt", max_keys=1)
    assert label(keys, "a", UNANSWERED) == "other"
    assert label(keys, "b", ANSWERED) not in ("other", "rejected")
    assert label(keys, "a", ANSWERED) == "other"  # the one place went to b


@no_proxy
def test_an_admitted_key_keeps_its_label_when_refused_later() -> None:
    """A revoked key shows as its own label's auth errors, not among made-up keys."""
    keys = KeyLabels("salt")
    admitted = label(keys, "sk-1", ANSWERED)
    assert label(keys, "sk-1", REFUSED) == admitted
    assert keys(bearer("sk-1")) == admitted  # known from now on when the request arrives


@no_proxy
def test_a_websocket_turn_admits_its_sessions_key() -> None:
    """A tunnel's turns are recorded only once the upstream took the upgrade (101, no
    ttfb of their own): they vouch for the key as an answer does."""
    keys = KeyLabels("salt")
    assert label(keys, "sk-ws", TURN) not in ("other", "rejected")


@no_proxy
def test_no_key_stays_none_whatever_the_answer() -> None:
    keys = KeyLabels("salt")
    assert [keys.settle(keys([]), m) for m in (ANSWERED, REFUSED, UNANSWERED)] == ["none"] * 3


@no_proxy
def test_workers_share_the_places_of_accepted_keys_only(tmp_path: Path) -> None:
    def worker() -> KeyLabels:
        return KeyLabels("salt", max_keys=2, ledger=FileLedger(ledger_path(str(tmp_path), "key")))

    a, b = worker(), worker()
    assert {label(b, f"junk{i}", REFUSED) for i in range(5)} == {"rejected"}
    first = label(a, "sk-1", ANSWERED)
    assert label(b, "sk-2", ANSWERED) not in ("other", first)
    assert label(b, "sk-1", ANSWERED) == first  # admitted by the other worker
    assert label(a, "sk-3", ANSWERED) == "other"
    ledger = (tmp_path / "tokenprobe-admitted-key").read_text()
    assert len(ledger.split()) == 2 and first in ledger and "sk-" not in ledger  # no junk


@no_proxy
def test_a_401_the_client_left_at_still_refuses_its_key() -> None:
    """A client that closes as the 401's head arrives ends client_cancelled, with a first
    byte: its made-up key was admitted (about 1 in 150 tries). The status refuses it."""
    left = measurement(status_code=401, error_type=ErrorType.CLIENT_CANCELLED)
    keys = KeyLabels("salt")
    assert label(keys, "made-up", left) == "rejected"
    assert label(keys, "made-up", ANSWERED) != "rejected"  # it took no place before


@no_proxy
def test_the_key_is_the_one_the_backend_checks_wherever_its_header_stands() -> None:
    """vLLM checks only Authorization's Bearer token, llama-server Authorization before
    X-Api-Key: a made-up x-api-key sent first is not the request's key."""
    keys = KeyLabels("salt")
    valid = keys.settle(keys(bearer("good")), ANSWERED)
    both = [(b"x-api-key", b"junk-1"), (b"api-key", b"junk-2"), *bearer("good")]
    assert keys.settle(keys(both), ANSWERED) == valid
    alone = keys.settle(keys([(b"x-api-key", b"llama-key")]), ANSWERED)
    assert alone not in (valid, "none", "other")  # the fallback without Authorization


@no_proxy
def test_a_key_another_worker_admitted_keeps_its_label_when_refused(tmp_path: Path) -> None:
    """Refused later in a worker that never saw it answered (its backend's key rotated):
    the shared ledger is asked, so the refusals stay under the key's label there too."""

    def worker() -> KeyLabels:
        return KeyLabels("salt", max_keys=2, ledger=FileLedger(ledger_path(str(tmp_path), "key")))

    a, b = worker(), worker()
    first = label(a, "sk-1", ANSWERED)
    assert label(b, "sk-1", REFUSED) == first
    assert label(b, "made-up", REFUSED) == "rejected"
    assert len((tmp_path / "tokenprobe-admitted-key").read_text().split()) == 1  # read only
