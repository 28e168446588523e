"""Builds a tiny random Llama model and a byte-level BPE tokenizer in a directory, with no download.

Run with the interpreter that has `transformers` and `tokenizers` (the vLLM venv):
`.venv-vllm/bin/python scripts/build_tiny_model.py OUT_DIR`. Sizes that CPU vLLM accepts: vocab ~1000,
hidden 128, 2 layers, 4 heads, head_dim 32 (CPU attention needs head_dim >= 32).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def corpus() -> list[str]:
    """Local text to train the tokenizer on: the repository's own docs and code."""
    root = Path(__file__).resolve().parents[1]
    texts = [p.read_text(errors="replace") for p in sorted(root.glob("**/*.md")) if ".venv" not in p.parts]
    texts += [p.read_text(errors="replace") for p in sorted((root / "tandem").glob("*.py"))]
    return texts or ["hello world " * 100]


def build(out: Path) -> None:
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    if (out / "model.safetensors").exists() and (out / "tokenizer_config.json").exists():
        return  # built already: `make clean` or delete the directory to rebuild
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        corpus(), vocab_size=1000, min_frequency=2, special_tokens=["<s>", "</s>", "<pad>"]
    )
    bpe.save(str(out / "tokenizer.json"))
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(out / "tokenizer.json"), bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out))
    # transformers 5 writes the template to chat_template.jinja only; the mesh's tokenizer (tandem/tokenizer.py)
    # reads it from tokenizer_config.json, as older files have it.
    config_path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(tokenizer_config, indent=2))
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(out))
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False}))


if __name__ == "__main__":
    build(Path(sys.argv[1] if len(sys.argv) > 1 else "build/tiny-llama"))
    print("ok")
