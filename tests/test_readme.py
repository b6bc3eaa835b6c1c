"""The README is a front page that tells the truth: its two commands are real, its first
screen states the contract the code implements (what is forwarded, measured and answered
by the proxy itself), and it stays short. The references it once held (settings, metrics,
APIs) are docs pages now, checked by tests/test_docs.py."""

from __future__ import annotations

import re

from proxy.core.apis import APIS
from proxy.core.wsseam import WS_APIS
from proxy.server.control import ControlPlane, Readiness
from tests.paths import ROOT

README = (ROOT / "README.md").read_text()
#: What a reader sees before scrolling: the first screen of a terminal or a GitHub page.
FIRST_SCREEN = "\n".join(README.splitlines()[:40])


def test_readme_gives_the_two_commands() -> None:
    assert "pip install . && tokenprobe demo" in README
    assert "pip install -e '.[dev]' && pytest" in README
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install -e '.[dev]' && pytest" in ci


def test_readme_is_a_front_page() -> None:
    assert len(README.splitlines()) <= 250


def _section(title: str) -> str:
    start = FIRST_SCREEN.index(f"**{title}")
    end = FIRST_SCREEN.find("\n- **", start + 1)
    return FIRST_SCREEN[start : end if end != -1 else None]


def test_the_first_screen_names_the_paths_the_proxy_answers_itself() -> None:
    plane = ControlPlane(None, Readiness("http://127.0.0.1:1"), apart=False)  # type: ignore[arg-type]
    own = sorted(plane.paths)
    said = sorted(set(re.findall(r"`(/[a-z]+)`", _section("Answered by the proxy itself"))))
    assert said == own
    assert "every request, whatever its method and path" in _section("Forwarded")


def test_the_first_screen_names_every_measured_api() -> None:
    """Each API of the registry is named in the first screen's "Measured" item, by the
    words listed here; a new API gets its words here and in the README."""
    words = {
        "/v1/chat/completions": "chat",
        "/v1/completions": "text completions",
        "/v1/messages": "Anthropic Messages",
        "/v1/responses": "Responses",
        "/v1/embeddings": "embeddings",
        "/pooling": "pooling",
        "/score": "score",
        "/rerank": "rerank",
        "/classify": "classify",
        "/inference/v1/generate": "token-in/token-out generate",
        "/v1/audio/transcriptions": "transcriptions",
        "/v1/audio/translations": "translations",
        "/cohere/v2/chat": "Cohere chat",
        "/v2/embed": "Cohere chat and embed (`/v2/embed`)",
        "/api/chat": "Ollama's chat",
        "/api/generate": "Ollama's chat, generate",
        "/api/embed": "Ollama's chat, generate and embed",
        "/completion": "llama.cpp's native `/completion`",
        "/v1/chat/completions/batch": "vLLM's batch chat",
        "/invocations": "SageMaker's `/invocations`",
        "/generative_scoring": "(`/generative_scoring`,",
        "/v1/systemone": "`/v1/systemone`)",
        "/v1/realtime": "`/v1/realtime`",
    }
    endpoints = sorted([api.endpoint for api in APIS] + [w.endpoint for w in WS_APIS])
    assert sorted(words) == endpoints, "name the new API in the README's first screen"
    measured = " ".join(_section("Measured").split())
    assert [e for e, w in words.items() if w not in measured] == []
