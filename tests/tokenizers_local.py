"""Tokenizers built or found locally, never downloaded: a tiny BPE trained here, and
Mistral's real SentencePiece vocabulary shipped inside the `mistral-common` package."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

if TYPE_CHECKING:
    from proxy.core.tokens import TokenCounter

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Measuring latency means time to first token and tokens per second.",
    "你好世界，今天天气很好。我们测量延迟。",
    "Streaming chunks arrive one by one 🙂 and each one is timed.",
]


def build_tiny_tokenizer(directory: Path) -> Path:
    """A byte-level BPE (every input encodes) saved for transformers.AutoTokenizer."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<s>"]
    )
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>").save_pretrained(str(directory))
    return directory


def mistral_tokenizer_dir(directory: Path) -> Path:
    """Mistral's SentencePiece model from mistral-common, laid out for AutoTokenizer."""
    import mistral_common

    data = Path(mistral_common.__file__).parent / "data"
    shutil.copy(data / "tokenizer.model.v1", directory / "tokenizer.model")
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizer",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
            }
        )
    )
    return directory


#: A chat template for tokenizers that ship none: without one, a chat prompt is not counted.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def with_chat_template(directory: Path) -> Path:
    """A tokenizer directory given CHAT_TEMPLATE, as a chat model's tokenizer has one."""
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def loaded_counter(directory: Path) -> TokenCounter:
    """A counter with a tiny tokenizer built in `directory`, once it has loaded. (Imported
    here: tests/vllm_model.py loads this module in the vLLM venv, which has no proxy.)"""
    from proxy.core.tokens import TokenCounter

    counter = TokenCounter(str(build_tiny_tokenizer(directory)))
    deadline = time.monotonic() + 30
    while not counter.ready and time.monotonic() < deadline:
        time.sleep(0.05)
    return counter
