"""Token counting with a local tokenizer, for backends that send no `usage`.

`transformers` is imported only here and only when `--tokenizer` is set: it is heavy, and
start-up must stay fast without it. Loading and counting run in one worker thread, off the
event loop, so a slow load or a long text never holds up other requests; until the
tokenizer is loaded, requests fall back to counting content events.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from proxy.core.measurement import TokenSource
from proxy.core.observe import StreamObserver, TokenCounts

log = logging.getLogger("tokenprobe")


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def count_prompt(tokenizer: Any, prompt: Any) -> int | None:
    """Prompt tokens: the chat template when the tokenizer has one, else the message texts."""
    if isinstance(prompt, str):
        return len(tokenizer.encode(prompt, add_special_tokens=True))
    if isinstance(prompt, list) and prompt and all(isinstance(p, dict) for p in prompt):
        if getattr(tokenizer, "chat_template", None):
            try:
                ids = tokenizer.apply_chat_template(
                    prompt, tokenize=True, add_generation_prompt=True
                )
                return len(ids["input_ids"] if isinstance(ids, dict) else ids)
            except Exception:
                pass
        texts = [m.get("content") for m in prompt]
        text = "\n".join(t for t in texts if isinstance(t, str))
        return len(tokenizer.encode(text, add_special_tokens=True))
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return len(prompt)  # completions accept token ids
    return None


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
        prompt = observer.request.prompt
        texts = list(observer.texts)
        echoed = observer.echoed_prompts()

        def work() -> TokenCounts:
            output = count_output(tokenizer, texts)
            if echoed:
                output = max(0, output - count_echoed(tokenizer, echoed))
            return TokenCounts(
                prompt=count_prompt(tokenizer, prompt),
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
