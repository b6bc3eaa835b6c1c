"""vLLM's batch chat, `POST /v1/chat/completions/batch`: N conversations in one request.

Wire facts (vllm/entrypoints/openai/chat_completion/protocol.py, BatchChatCompletionRequest;
batch_serving.py, chat_completion_full_generator_batch): `messages` is a list of
conversations; the answer is one non-streamed chat completion (`object:
"chat.completion"`) with one choice per conversation, `index` 0..N-1, each with its own
`finish_reason`, and one `usage` summing every conversation's prompt and output tokens.
Its request model has no `stream`: `stream: true` is ignored, the answer is whole.
So it is measured as a non-streamed chat with several choices.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

from proxy.core.apis.base import RequestInfo
from proxy.core.apis.chat import Chat


class BatchChat(Chat):
    endpoint = "/v1/chat/completions/batch"
    paths: ClassVar[tuple[str, ...]] = ("/v1/chat/completions/batch",)
    bench_name = ""
    takes_messages = False
    measures = (
        "never streamed: e2e latency, prompt and output tokens from usage (every "
        "conversation together), finish_reason of each choice (one per conversation), "
        "error type"
    )

    def read_request(self, obj: dict[str, Any]) -> RequestInfo:
        """Never a stream: vLLM's request model has no `stream`, so `stream: true` is
        ignored and answered whole (seen from the real vLLM 0.32,
        tests/fixtures/streams/vllm-0.32/batch_chat_stream_ignored.json)."""
        info = super().read_request(obj)
        return replace(info, stream=False) if info.stream else info

    def prompt(self, obj: dict[str, Any]) -> Any:
        """None: `messages` holds several conversations, no one prompt a tokenizer or the
        conversation table could read (the answer's usage counts them all)."""
        return None

    def template(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        return None

    def ask_for_usage(self, obj: dict[str, Any], body: bytes) -> bytes | None:
        return None  # never streamed: the body always has usage
