"""Capture the fixtures of tests/fixtures/streams/llamacpp/ from a running llama-server:
    python tests/llamacpp/capture.py http://127.0.0.1:PORT OUT_DIR [NAME ...]
Each file is the response body byte for byte; index.json gives each one's request."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx

CHAT = "/v1/chat/completions"
LONG = "measure the cache: " + " ".join(f"word{i}" for i in range(40))
#: A grammar that leaves the model two words, then nothing but its EOS: a "stop" answer
#: of 2 text tokens and the EOS, which llama-server counts (n_decoded).
TWO_WORDS = 'root ::= " upon upon"'
#: Three words for a stop word to cut: " upon" ends with "on", the start of "on u", so the
#: first token's text is held back; the second completes it (the text sent: " up").
THREE_WORDS = 'root ::= " upon upon upon"'
STOP = ["on u"]
#: Starts that never complete: " upon" ends with "on", so all the text is held until the EOS.
NEVER = ["on x"]


#: A native completion's common members.
NATIVE: dict[str, Any] = {"prompt": "once upon", "temperature": 0, "cache_prompt": False}


def chat(prompt: str, **extra: Any) -> dict[str, Any]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 5}
    return {**body, "temperature": 0, **extra}


REQUESTS: list[tuple[str, str, dict[str, Any]]] = [
    ("chat_stream_no_usage.sse", CHAT, chat("hello there", stream=True, cache_prompt=False)),
    (
        "chat_stream_include_usage.sse",
        CHAT,
        chat(
            "hello there",
            stream=True,
            cache_prompt=False,
            stream_options={"include_usage": True},
        ),
    ),
    ("chat_stream_cold.sse", CHAT, chat(LONG, stream=True, stream_options={"include_usage": True})),
    (
        "chat_stream_cached.sse",
        CHAT,
        chat(LONG, stream=True, stream_options={"include_usage": True}),
    ),
    ("chat_nonstream.json", CHAT, chat("hello there", cache_prompt=False)),
    (
        "completions_stream_no_usage.sse",
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": "once upon",
            "max_tokens": 5,
            "temperature": 0,
            "stream": True,
            "cache_prompt": False,
        },
    ),
    # llama.cpp's native completion (proxy/core/apis/llamacpp.py)
    (
        "native_completion_stream.sse",
        "/completion",
        {
            "prompt": "once upon",
            "n_predict": 5,
            "temperature": 0,
            "stream": True,
            "cache_prompt": False,
        },
    ),
    (
        "native_completion.json",
        "/completion",
        {"prompt": "once upon", "n_predict": 5, "temperature": 0, "cache_prompt": False},
    ),
    # answers that end with the EOS (TWO_WORDS)
    (
        "chat_stream_eos.sse",
        CHAT,
        chat("hello there", stream=True, cache_prompt=False, grammar=TWO_WORDS),
    ),
    ("chat_eos.json", CHAT, chat("hello there", cache_prompt=False, grammar=TWO_WORDS)),
    (
        "completions_stream_eos.sse",
        "/v1/completions",
        {**NATIVE, "max_tokens": 5, "stream": True, "grammar": TWO_WORDS},
    ),
    (
        "native_completion_eos_stream.sse",
        "/completion",
        {**NATIVE, "n_predict": 5, "stream": True, "grammar": TWO_WORDS},
    ),
    ("native_completion_eos.json", "/completion", {**NATIVE, "n_predict": 5, "grammar": TWO_WORDS}),
    # stop words (proxy/sim/llamacpp_words.py): held back, cut, and what n_predict and EOS do
    (
        "native_completion_stop_stream.sse",
        "/completion",
        {**NATIVE, "n_predict": 5, "stream": True, "grammar": THREE_WORDS, "stop": STOP},
    ),
    (
        "native_completion_stop.json",
        "/completion",
        {**NATIVE, "n_predict": 5, "grammar": THREE_WORDS, "stop": STOP},
    ),
    (
        "native_completion_stop_limit_stream.sse",
        "/completion",
        {**NATIVE, "n_predict": 1, "stream": True, "grammar": THREE_WORDS, "stop": STOP},
    ),
    (
        "native_completion_stop_limit.json",
        "/completion",
        {**NATIVE, "n_predict": 1, "grammar": THREE_WORDS, "stop": STOP},
    ),
    (
        "native_completion_stop_eos_stream.sse",
        "/completion",
        {**NATIVE, "n_predict": 5, "stream": True, "grammar": TWO_WORDS, "stop": NEVER},
    ),
    (
        "completions_stream_stop.sse",
        "/v1/completions",
        {**NATIVE, "max_tokens": 5, "stream": True, "grammar": THREE_WORDS, "stop": STOP},
    ),
    (
        "completions_stream_stop_eos.sse",
        "/v1/completions",
        {**NATIVE, "max_tokens": 5, "stream": True, "grammar": TWO_WORDS, "stop": NEVER},
    ),
    (
        "chat_stream_stop.sse",
        CHAT,
        chat("hello there", stream=True, cache_prompt=False, grammar=THREE_WORDS, stop=STOP),
    ),
    (
        "chat_stream_stop_eos.sse",
        CHAT,
        chat("hello there", stream=True, cache_prompt=False, grammar=TWO_WORDS, stop=NEVER),
    ),
    (
        "chat_stop.json",
        CHAT,
        chat("hello there", cache_prompt=False, grammar=THREE_WORDS, stop=STOP),
    ),
    # n > 1: a task per choice (`n` is `n_cmpl`), side by side only with a slot each, so
    # captured from a server started with `--parallel 2` (index.json: server_flags)
    (
        "chat_n2_stream_no_usage.sse",
        CHAT,
        chat("hello there", n=2, stream=True, cache_prompt=False),
    ),
    (
        "chat_n2_stream_include_usage.sse",
        CHAT,
        chat(
            "hello there",
            n=2,
            stream=True,
            cache_prompt=False,
            stream_options={"include_usage": True},
        ),
    ),
    ("chat_n2.json", CHAT, chat("hello there", n=2, cache_prompt=False)),
    (
        "completions_n2_stream.sse",
        "/v1/completions",
        {**NATIVE, "model": "tiny", "max_tokens": 5, "n": 2, "stream": True},
    ),
    (
        "completions_2_prompts_n2_stream.sse",
        "/v1/completions",
        {
            **NATIVE,
            "model": "tiny",
            "prompt": ["once upon", "hello there my friend"],
            "max_tokens": 5,
            "n": 2,
            "stream": True,
        },
    ),
]


def main(url: str, out: Path, only: set[str] | None = None) -> None:
    """Capture every request, or those named in `only` (the index keeps the others)."""
    out.mkdir(parents=True, exist_ok=True)
    index = json.loads((out / "index.json").read_text())["requests"] if only else {}
    with httpx.Client(timeout=60) as client:
        version = client.get(url + "/props").json().get("build_info")
        for name, path, body in REQUESTS:
            if only and name not in only:
                continue
            with client.stream("POST", url + path, json=body) as response:
                data = b"".join(response.iter_raw())
            (out / name).write_bytes(data)
            index[name] = {"path": path, "body": body, "status": response.status_code}
    meta = {"server": "llama-server", "build_info": version, "requests": index}
    (out / "index.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), set(sys.argv[3:]) or None)
