"""A tiny random-weight Llama as GGUF, for a real llama.cpp `llama-server`: built here, from
nothing that comes from a hub.

Run with a Python that has torch, transformers, sentencepiece and mistral-common (the vLLM
venv has all four; .ci/llama runs it so):
    python tests/llama_model.py SRC OUT.gguf
SRC holds llama.cpp's `convert_hf_to_gguf.py`, `conversion/` and `gguf-py` (which the
converter puts on its own path) (.ci/llama copies them from the
llama-cpp-python sdist's vendor/llama.cpp). The Hugging Face model is written to a
temporary directory: config.json, safetensors weights from a fixed seed, and the
SentencePiece `tokenizer.model` that the mistral-common wheel ships (mistral_common/data/
tokenizer.model.v1, 32000 pieces); llama.cpp's converter refuses a locally trained BPE
tokenizer ("BPE pre-tokenizer was not recognized") and reads a SentencePiece model as it
is. The chat template goes into tokenizer_config.json, which the converter copies into the
GGUF (`tokenizer.chat_template`). Idempotent: an existing OUT.gguf is left as it is.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: The served context length: small, so the KV cache is small on a 2-core machine.
CONTEXT = 512
#: A plain template in the tokenizer's own words ([INST] ... [/INST] is Mistral's).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ message['content'] }}{{ eos_token }}{% else %}[INST] {{ message['content'] }} [/INST]"
    "{% endif %}{% endfor %}"
)


def tokenizer_model() -> Path:
    import mistral_common

    path = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
    if not path.exists():
        raise SystemExit(f"no SentencePiece model at {path} (mistral-common's wheel ships it)")
    return path


def write_hf_model(directory: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    shutil.copy(tokenizer_model(), directory / "tokenizer.model")
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizer",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": True,
                "add_eos_token": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=1,
        )
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=CONTEXT,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
        dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(str(directory), safe_serialization=True)


def build(src: Path, out: Path) -> Path:
    """Write `out` unless it is already there."""
    if out.exists():
        return out
    converter = src / "convert_hf_to_gguf.py"
    if not converter.exists():
        raise SystemExit(f"no {converter}")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        hf.mkdir()
        write_hf_model(hf)
        done = subprocess.run(
            [
                sys.executable,
                str(converter),
                str(hf),
                "--outfile",
                str(partial),
                "--outtype",
                "f32",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
            raise SystemExit(f"convert_hf_to_gguf.py failed ({done.returncode})")
    partial.rename(out)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python tests/llama_model.py SRC OUT.gguf", file=sys.stderr)
        return 2
    started = time.monotonic()
    out = Path(argv[1])
    existed = out.exists()
    build(Path(argv[0]), out)
    what = "already there" if existed else "built"
    size = out.stat().st_size / 1e6
    print(f"tiny GGUF {out} ({size:.1f} MB): {what} in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
