"""A tiny random-weight Llama that a real vLLM can serve, built here: nothing comes from a hub.

Run with the Python of the vLLM venv (it has torch and transformers):
    python tests/vllm_model.py DIR
It writes DIR/config.json, the safetensors weights and a byte-level BPE tokenizer
(tests/tokenizers_local.py) with a chat template, so `vllm serve DIR` and
`AutoTokenizer.from_pretrained(DIR)` both load it. With `--reasoning`
(`python tests/vllm_model.py --reasoning DIR`) the tokenizer also has `<think>`,
`</think>`, `<tool_call>` and `</tool_call>` as added tokens, not special ones, so vLLM's
`--reasoning-parser deepseek_r1` and `--tool-call-parser hermes` find them in its vocabulary
(vllm/reasoning/basic_parsers.py and the hermes tool parser look their ids up there). Idempotent: a complete DIR is left as it
is (DIR/.complete marks one). The weights come from a fixed seed, so two builds answer alike.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

#: The served context length: small, so the KV cache is small on a 2-core machine.
MAX_MODEL_LEN = 256
#: A chat template (ChatML-like) so /v1/chat/completions has one: tokenizers carry none.
CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
MARK = ".complete"
#: The added tokens of the reasoning model: vLLM's deepseek_r1 reasoning parser and hermes
#: tool parser need them as single tokens; not special, so they are streamed as text.
REASONING_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")


def build(directory: Path, reasoning: bool = False) -> Path:
    """Build the model in `directory` unless a complete one is already there (with the
    reasoning and tool-call tokens added when `reasoning`)."""
    if (directory / MARK).exists():
        return directory
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.tokenizers_local import build_tiny_tokenizer

    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    build_tiny_tokenizer(partial)
    if reasoning:
        from tokenizers import AddedToken
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(partial))
        tokenizer.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t in REASONING_TOKENS]
        )
        tokenizer.save_pretrained(str(partial))
    config_path = partial / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["chat_template"] = CHAT_TEMPLATE
    tok_config["eos_token"] = "<s>"
    config_path.write_text(json.dumps(tok_config, indent=1))
    tokenizer_json = json.loads((partial / "tokenizer.json").read_text())
    vocab = {**tokenizer_json["model"]["vocab"]}
    vocab.update({t["content"]: t["id"] for t in tokenizer_json["added_tokens"]})

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,  # vLLM's CPU attention refuses head_dim 16
        max_position_embeddings=MAX_MODEL_LEN,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=True,
        dtype="bfloat16",
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(
        str(partial), safe_serialization=True
    )
    (partial / MARK).write_text("built by tests/vllm_model.py\n")
    shutil.rmtree(directory, ignore_errors=True)
    partial.rename(directory)
    return directory


def main(argv: list[str]) -> int:
    reasoning = argv[:1] == ["--reasoning"]
    if reasoning:
        argv = argv[1:]
    if len(argv) != 1:
        print("usage: python tests/vllm_model.py [--reasoning] DIR", file=sys.stderr)
        return 2
    started = time.monotonic()
    directory = Path(argv[0])
    existed = (directory / MARK).exists()
    build(directory, reasoning)
    what = "already there" if existed else "built"
    print(f"tiny model {directory}: {what} in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
