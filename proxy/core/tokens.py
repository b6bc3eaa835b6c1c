"""Token counting with a local tokenizer, for backends that send no `usage`.

`transformers` is imported only here and only when `--tokenizer` is set: it is heavy, and
start-up must stay fast without it. Loading and counting run in one worker thread, off the
event loop, so a slow load or a long text never holds up other requests; until the
tokenizer is loaded, requests fall back to counting content events. A count the tokenizer
fails (it raises) is no count either: the record keeps its timings and falls back alike,
and `tokenprobe_measurement_failures_total{stage="tokenizer"}` says so.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from proxy.core.apis import RequestInfo
from proxy.core.apis.responses import Responses
from proxy.core.chat_prompt import (
    parsed_arguments,
    responses_messages,
    responses_options,
    template_kwargs,
    template_messages,
)
from proxy.core.lax import lax_bool
from proxy.core.measurement import TokenSource
from proxy.core.observe import StreamObserver, TokenCounts
from proxy.core.request import TokenIds

log = logging.getLogger("tokenprobe")

T = TypeVar("T")
#: Told a measuring stage's name when counting fails (Sinks.count_measurement_failure).
Failed = Callable[[str], None]
#: `tokenprobe_measurement_failures_total{stage}` of a count the tokenizer failed.
FAILURE_STAGE = "tokenizer"


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def count_request(tokenizer: Any, request: RequestInfo) -> int | None:
    """A request's prompt tokens for its record, as vLLM counts them: `count_prompt` with
    the request's template options and `template_only`; a Responses request's input items
    made chat messages as vLLM makes them, with its options (chat_prompt.responses_messages
    and responses_options). None for a Responses request that continues a stored response
    (`previous_response_id`): vLLM puts that conversation before the input
    (responses/serving.py:285-310; responses/utils.py:264-281), and the proxy does not
    see it."""
    prompt = request.prompt
    if request.endpoint != Responses.endpoint:
        return count_prompt(tokenizer, prompt, request.template, template_only=True)
    if request.previous_response_id is not None or not isinstance(prompt, list):
        return None
    messages = responses_messages(prompt)
    if not messages:
        return None
    options = responses_options(prompt, request.template)
    return count_chat(tokenizer, template_messages(messages), options)


def count_prompt(
    tokenizer: Any,
    prompt: Any,
    template: dict[str, Any] | None = None,
    *,
    template_only: bool = False,
) -> int | None:
    """Prompt tokens: a text; token ids; a batch of texts or of token-id lists (each
    prompt's own, added up, as vLLM's usage adds them: completion/serving.py); messages
    through the chat template, with the request's own template options (`template`:
    RequestInfo.template, see `count_chat`).

    Messages the chat template cannot render (the tokenizer has none, or it refuses them)
    are counted as their texts joined, unless `template_only`: then None. That joined count
    is no prompt vLLM ever tokenized (it would have used another template, or answered
    400): the proxy's records take `template_only`, so no such figure is labelled
    `tokenizer`; the benchmark's prompt sizing keeps it."""
    if isinstance(prompt, str):
        return len(tokenizer.encode(prompt, add_special_tokens=True))
    if isinstance(prompt, TokenIds):  # token ids, kept as their count (proxy/core/request.py)
        return prompt.count
    if not isinstance(prompt, list) or not prompt:
        return None
    if all(type(p) is int for p in prompt):
        return len(prompt)  # completions accept token ids
    if all(isinstance(p, dict) for p in prompt):
        messages = template_messages(prompt)
        counted = count_chat(tokenizer, messages, template or {})
        if counted is not None or template_only:
            return counted
        texts = [m.get("content") for m in messages]
        text = "\n".join(t for t in texts if isinstance(t, str))
        return len(tokenizer.encode(text, add_special_tokens=True))
    if all(isinstance(p, (str, TokenIds))
           or (isinstance(p, list) and p and all(type(i) is int for i in p))
           for p in prompt):  # fmt: skip
        return sum(count_prompt(tokenizer, p) or 0 for p in prompt)
    return None


def count_chat(
    tokenizer: Any, messages: list[dict[str, Any]], template: dict[str, Any]
) -> int | None:
    """The tokens of chat messages as vLLM makes them (renderers/hf.py, render_messages and
    safe_apply_chat_template; renderers/base.py, _tokenize_prompt): the template rendered
    to a text with vLLM's keyword arguments (chat_prompt.template_kwargs) and the tool
    calls' arguments as dicts (chat_prompt.parsed_arguments), then that text encoded with
    the request's `add_special_tokens` (chat_completion/protocol.py, build_tok_params:
    default false, for the template writes its own special tokens; true adds the
    tokenizer's BOS on top, as vLLM does; a Responses request's is true:
    chat_prompt.responses_options). None where there is no chat template or it
    refuses these messages (vLLM answers that 400), and where the request brings its own
    `chat_template`: a client's Jinja is not run in the proxy (its loops could hold the
    one counting thread), and vLLM refuses it unless started with
    --trust-request-chat-template."""
    given = template.get("chat_template_kwargs")
    if (
        not getattr(tokenizer, "chat_template", None)
        or template.get("chat_template")
        or (isinstance(given, dict) and "chat_template" in given)
    ):
        return None
    kwargs = template_kwargs(template)
    try:
        rendered = tokenizer.apply_chat_template(parsed_arguments(messages), **kwargs)
    except Exception as exc:  # a template that refuses these messages (raise_exception)
        log.debug("the chat template refused a prompt: %s", type(exc).__name__)
        return None
    if isinstance(rendered, str):
        special = lax_bool(template.get("add_special_tokens")) is True
        return len(tokenizer.encode(rendered, add_special_tokens=special))
    # chat_template_kwargs `tokenize: true` wins over vLLM's false: the ids, as rendered
    return len(rendered["input_ids"] if isinstance(rendered, Mapping) else rendered)


def count_output(tokenizer: Any, texts: list[str]) -> int:
    return len(tokenizer.encode("".join(texts), add_special_tokens=False))


def count_choices(tokenizer: Any, choices: list[tuple[list[str], Any]]) -> int:
    """Output tokens of several choices (n > 1, a batch of prompts): each choice's texts
    counted alone and added up, as vLLM adds each choice's token ids (completion_tokens:
    chat_completion/serving.py, completion/serving.py), less the prompt its `echo` put
    before them (None: none), counted as `count_echoed` counts it. A reasoning's tokens
    are counted alike: vLLM counts each choice's in its own token ids and adds them up
    (chat_completion/serving.py:833-836 and 848 streamed, 1007 whole)."""
    total = 0
    for texts, echoed in choices:
        output = count_output(tokenizer, texts)
        if echoed is not None:
            output = max(0, output - count_echoed(tokenizer, [echoed]))
        total += output
    return total


def count_echoed(tokenizer: Any, prompts: list[Any]) -> int:
    """Tokens of the prompts a completions `echo` put before the output: a text's tokens,
    a list of token ids' length (vLLM echoes their text; its length is theirs)."""
    total = 0
    for prompt in prompts:
        if isinstance(prompt, str):
            total += len(tokenizer.encode(prompt, add_special_tokens=False))
        elif isinstance(prompt, list):
            total += len(prompt)
        elif isinstance(prompt, TokenIds):
            total += prompt.count
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

    async def count(
        self, observer: StreamObserver, failed: Failed | None = None
    ) -> TokenCounts | None:
        """Counts for a finished response, or None while the tokenizer is not ready or when
        counting failed (`failed("tokenizer")` is told): the record then keeps its timings
        and counts as it would without a tokenizer."""
        if not self.ready:
            return None
        tokenizer = self._loading.result()
        request = observer.request
        choices = [(list(texts), echoed) for texts, echoed in observer.choice_outputs()]

        def work() -> TokenCounts:
            return TokenCounts(
                prompt=count_request(tokenizer, request),
                output=count_choices(tokenizer, choices),
                cached=None,
                source=TokenSource.TOKENIZER,
            )

        return await self._run(work, failed)

    async def count_reasoning(
        self, observer: StreamObserver, failed: Failed | None = None
    ) -> int | None:
        """Tokens of a finished response's reasoning, each choice's counted alone and added
        up as its output is (`count_choices`), None while not ready or when counting failed
        (`failed("tokenizer")` is told)."""
        if not self.ready:
            return None
        tokenizer = self._loading.result()
        choices = [(list(texts), None) for texts in observer.choice_reasoning()]
        return await self._run(lambda: count_choices(tokenizer, choices), failed)

    async def _run(self, work: Callable[[], T], failed: Failed | None) -> T | None:
        """`work` in the tokenizer's thread. A tokenizer that raises (a broken file, a text
        it cannot take) loses the request its token counts, never its record."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, work)
        except Exception as exc:
            # the type alone: a tokenizer's message may quote the text, a client's prompt
            log.warning("counting tokens with %s failed: %s", self.path, type(exc).__name__)
            if failed is not None:
                failed(FAILURE_STAGE)
            return None

    def reporting(self, failed: Failed) -> Reporting:
        """This counter as one request's finish uses it, its failures told to `failed`
        (`tokenprobe_measurement_failures_total{stage="tokenizer"}`)."""
        return Reporting(self, failed)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class Reporting:
    """A TokenCounter for one request (proxy.core.observe.Counter), whose failed counts
    are told to `failed`."""

    __slots__ = ("counter", "failed")

    def __init__(self, counter: TokenCounter, failed: Failed) -> None:
        self.counter = counter
        self.failed = failed

    async def count(self, observer: StreamObserver) -> TokenCounts | None:
        return await self.counter.count(observer, self.failed)

    async def count_reasoning(self, observer: StreamObserver) -> int | None:
        return await self.counter.count_reasoning(observer, self.failed)
