"""vLLM 0.32's batch chat, `POST /v1/chat/completions/batch`, played as one chat.

vLLM (vllm/entrypoints/openai/chat_completion/protocol.py, BatchChatCompletionRequest;
batch_serving.py, chat_completion_full_generator_batch) takes `messages` as a list of
conversations (at least one, each of at least one message) and answers one non-streamed
ChatCompletionResponse: one choice per conversation, `index` 0..N-1, `usage` summing
every conversation's tokens, `"metrics": null`. Its request model has no `stream`, so a
`stream: true` is ignored and answered whole (seen from the real vLLM 0.32,
tests/fixtures/streams/vllm-0.32/batch_chat_nonstream.json). The simulator plays it as one
chat of all the conversations' messages with `n` choices: the same body, key for key.
"""

from __future__ import annotations

from typing import Any


def as_chat(body: Any) -> dict[str, Any] | None:
    """The chat body that plays this batch, None when `messages` is no non-empty list of
    non-empty conversations (vLLM's 400)."""
    if not isinstance(body, dict):
        return None
    conversations = body.get("messages")
    if not isinstance(conversations, list) or not conversations:
        return None
    if not all(isinstance(c, list) and c for c in conversations):
        return None
    messages = [message for conversation in conversations for message in conversation]
    return {**body, "messages": messages, "n": len(conversations), "stream": False}
