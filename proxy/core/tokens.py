"""Token counting with a local tokenizer, for backends that send no `usage`.

`transformers` is imported only here and only when `--tokenizer` is set: it is heavy, and
start-up must stay fast without it. Loading and counting run in one worker thread, off the
event loop, so a slow load or a long text never holds up other requests; until the
tokenizer is loaded, requests fall back to counting content events.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from proxy.core.chat_prompt import template_messages
from proxy.core.measurement import TokenSource
from proxy.core.observe import StreamObserver, TokenCounts

log = logging.getLogger("tokenprobe")


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def count_prompt(tokenizer: Any, prompt: Any, template: dict[str, Any] | None = None) -> int | None:
    """Prompt tokens: a text; token ids; a batch of texts or of token-id lists (each
    prompt's own, added up, as vLLM's usage adds them: completion/serving.py); messages
    through the chat template when the tokenizer has one, with the request's own template
    options (`template`: RequestInfo.template), else their texts."""
    if isinstance(prompt, str):
        return len(tokenizer.encode(prompt, add_special_tokens=True))
    if not isinstance(prompt, list) or not prompt:
        return None
    if all(type(p) is int for p in prompt):
        return len(prompt)  # completions accept token ids
    if all(isinstance(p, dict) for p in prompt):
        return _count_chat(tokenizer, template_messages(prompt), template or {})
    if all(isinstance(p, str) or (isinstance(p, list) and p and all(type(i) is int for i in p))
           for p in prompt):  # fmt: skip
        return sum(count_prompt(tokenizer, p) or 0 for p in prompt)
    return None


def _count_chat(tokenizer: Any, messages: list[dict[str, Any]], template: dict[str, Any]) -> int:
    if getattr(tokenizer, "chat_template", None):
        extra = template.get("chat_template_kwargs")
        try:
            ids = tokenizer.apply_chat_template(
                messages,
                tokenize=True,
                # transformers 5 answers a BatchEncoding by default; vLLM asks for the ids
                # alone too (vllm/renderers/hf.py, safe_apply_chat_template)
                return_dict=False,
                add_generation_prompt=template.get("add_generation_prompt", True),
                continue_final_message=template.get("continue_final_message", False),
                tools=template.get("tools"),
                **(extra if isinstance(extra, dict) else {}),
            )
            return len(ids["input_ids"] if isinstance(ids, Mapping) else ids)
        except Exception:  # a template that refuses these messages: their texts below
            pass
    texts = [m.get("content") for m in messages]
    text = "\n".join(t for t in texts if isinstance(t, str))
    return len(tokenizer.encode(text, add_special_tokens=True))


def count_output(tokenizer: Any, texts: list[str]) -> int:
    return len(tokenizer.encode("".join(texts), add_special_tokens=False))


def count_echoed(tokenizer: Any, prompts: list[Any]) -> int:
    """Tokens of the prompts a completions `echo` put before the output: a text's tokens,
    a list of token ids' length (vLLM echoes their text; its length is theirs)."""
    total = 0
    for prompt in prompts:
        if isinstance(prompt, str):
            total += len(tokenizer.encode(prompt, add_special_tokens=False))
        elif isinstance(prompt, list):
            total += len(prompt)
    return total


class TokenCounter:
    def __init__(self, path: str) -> None:
        self.path = path
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self._loading: Future[Any] = self._executor.submit(load_tokenizer, path)
        self._loading.add_done_callback(self._loaded)

    def _loaded(self, future: Future[Any]) -> None:
        if future.exception() is not None:
            log.error("could not load tokenizer from %s: %s", self.path, future.exception())

    @property
    def ready(self) -> bool:
        return self._loading.done() and self._loading.exception() is None

    async def count(self, observer: StreamObserver) -> TokenCounts | None:
        """Counts for a finished response, or None while the tokenizer is not ready."""
        if not self.ready:
            return None
        tokenizer = self._loading.result()
        prompt, template = observer.request.prompt, observer.request.template
        texts = list(observer.texts)
        echoed = observer.echoed_prompts()

        def work() -> TokenCounts:
            output = count_output(tokenizer, texts)
            if echoed:
                output = max(0, output - count_echoed(tokenizer, echoed))
            return TokenCounts(
                prompt=count_prompt(tokenizer, prompt, template),
                output=output,
                cached=None,
                source=TokenSource.TOKENIZER,
            )

        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, work)

    async def count_texts(self, texts: list[str]) -> int | None:
        """Tokens of generated texts (a stream's reasoning), None while not ready."""
        if not self.ready:
            return None
        tokenizer = self._loading.result()
        joined = list(texts)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: count_output(tokenizer, joined))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
