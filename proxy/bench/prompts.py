"""Prompts: a built-in varied set, a user's file, or synthetic prompts of an exact token length.

A prompt is either a plain text or a chat `messages` list; `payload()` turns it into what
the chosen endpoint takes. Exact-length prompts are measured the way the proxy counts a
prompt (`proxy.core.tokens.count_prompt`: the chat template when the tokenizer has one).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from proxy.core.apis import api_for
from proxy.core.tokens import count_prompt


class PromptError(ValueError):
    """A prompts file or a synthetic prompt that cannot be built; the message says why."""


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None

    def payload(self, endpoint: str) -> Any:
        """`messages` for the APIs whose seam `takes_messages` (chat, Anthropic Messages,
        Cohere), a text for the others."""
        api = api_for(endpoint)
        if api is not None and api.takes_messages:
            if self.messages is not None:
                return list(self.messages)
            return [{"role": "user", "content": self.text}]
        if self.text is not None:
            return self.text
        return "\n".join(str(m.get("content", "")) for m in self.messages or ())


_LONG_EN = (
    "You are reviewing a design document for a distributed key-value store. The store "
    "replicates every write to three nodes using a leader-based consensus protocol, "
    "keeps an in-memory index backed by a log-structured merge tree on disk, and serves "
    "reads from any replica with a configurable staleness bound. Clients connect through "
    "a thin routing layer that caches the cluster map and retries on leader changes. "
    "The document claims p99 write latency under five milliseconds within one region, "
    "linear read scaling with replica count, and no data loss when one node fails. "
    "List the assumptions behind each claim, the failure modes that would break them "
    "(network partitions, clock skew, slow disks, compaction stalls, hot keys), the "
    "measurements you would ask for before believing the numbers, and the design "
    "changes you would suggest to make the latency claim hold under a node failure."
)
_LONG_ZH = (
    "请阅读下面这段关于城市公共交通规划的说明，并写一份详细的评审意见。该市计划在未来五年内"
    "新建三条地铁线路，总长约一百二十公里，同时把现有的公交线路按照地铁站点重新编排，形成"
    "“干线加接驳”的网络。规划称高峰时段平均通勤时间将缩短百分之二十，公交与地铁的换乘"
    "距离不超过三百米，并且票价保持不变。请分别说明这些目标所依赖的前提条件、可能遇到的"
    "困难（例如施工对交通的影响、客流预测的误差、运营成本上升、老旧城区的道路条件），"
    "你会要求规划部门补充哪些数据，以及你对分期建设顺序的建议。"
)

BUILTIN: tuple[Prompt, ...] = (
    Prompt("Say hello in three languages."),
    Prompt("用一句话解释什么是机器学习。"),
    Prompt("Write a haiku about a server room at night."),
    Prompt("给我推荐三本适合初学者的编程书，并说明理由。"),
    Prompt("Explain the difference between latency and throughput to a new engineer."),
    Prompt("北京和上海的气候有什么不同？请从温度、降水和季节三个方面比较。"),
    Prompt(
        messages=(
            {"role": "system", "content": "You are a concise assistant for software engineers."},
            {"role": "user", "content": "How do I find which process holds a TCP port on Linux?"},
        )
    ),
    Prompt(
        messages=(
            {"role": "system", "content": "你是一名耐心的数学老师。"},
            {"role": "user", "content": "请一步一步地证明根号二是无理数。"},
        )
    ),
    Prompt("Summarise the plot of a detective story you invent, in about two hundred words."),
    Prompt("写一个Python函数，判断一个字符串是不是回文，并给出三个测试用例。"),
    Prompt(_LONG_EN),
    Prompt(_LONG_ZH),
)


def load_file(path: str) -> list[Prompt]:
    """JSONL of {"prompt": ...} or {"messages": [...]}, else plain text, one prompt per line."""
    try:
        lines = [
            line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()
        ]
    except OSError as exc:
        raise PromptError(f"--prompts: cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise PromptError(f"--prompts: {path} is not UTF-8 text") from None
    if not lines:
        raise PromptError(f"--prompts: {path} has no prompts")
    if not lines[0].lstrip().startswith("{"):
        return [Prompt(line) for line in lines]
    prompts = []
    for number, line in enumerate(lines, 1):
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError:
            raise PromptError(f"--prompts: {path}:{number} is not valid JSON") from None
        prompts.append(_from_json(obj, f"{path}:{number}"))
    return prompts


def _from_json(obj: Any, where: str) -> Prompt:
    if isinstance(obj, dict):
        if isinstance(obj.get("prompt"), str):
            return Prompt(obj["prompt"])
        messages = obj.get("messages")
        if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
            return Prompt(messages=tuple(messages))
    raise PromptError(f'--prompts: {where} needs a "prompt" string or a "messages" list')


def synthetic(tokenizer: Any, tokens: int, count: int, endpoint: str, seed: int) -> list[Prompt]:
    """`count` different prompts of exactly `tokens` tokens each, as the proxy counts them.

    Different texts, so a prefix cache cannot serve one request from another's work.
    """
    rng = random.Random(seed)
    pool = _word_ids(tokenizer, rng)
    return [_exact(tokenizer, tokens, endpoint, pool, rng) for _ in range(count)]


def _word_ids(tokenizer: Any, rng: random.Random) -> list[int]:
    """Ordinary (non-special) token ids that decode to something and re-encode to themselves."""
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    size = len(tokenizer)
    candidates = [i for i in rng.sample(range(size), min(size, 4000)) if i not in special]
    pool = []
    for i in candidates:
        text = tokenizer.decode([i])
        if (
            text.strip()
            and text.isprintable()  # no control characters in a prompt
            and tokenizer.encode(text, add_special_tokens=False) == [i]
        ):
            pool.append(i)
    if not pool:
        raise PromptError(
            "--input-tokens: the tokenizer has no ordinary tokens to build prompts from"
        )
    return pool


def _exact(
    tokenizer: Any, tokens: int, endpoint: str, pool: list[int], rng: random.Random
) -> Prompt:
    ids = rng.choices(pool, k=tokens)
    for _ in range(50):
        prompt = Prompt(tokenizer.decode(ids))
        got = count_prompt(tokenizer, prompt.payload(endpoint))
        if got == tokens:
            return prompt
        assert got is not None
        if got > tokens:
            if len(ids) == 1:
                break
            ids = ids[: max(1, len(ids) - (got - tokens))]
        else:
            ids = ids + rng.choices(pool, k=tokens - got)
    overhead = count_prompt(tokenizer, Prompt(tokenizer.decode(pool[:1])).payload(endpoint))
    raise PromptError(
        f"--input-tokens: cannot build a prompt of exactly {tokens} tokens with this tokenizer "
        f"(one word already counts {overhead} with the chat template and special tokens)"
    )
