"""Builds a tiny LoRA adapter (PEFT's on-disk format, random weights) for the tiny model of
`scripts/build_tiny_model.py`, with no download and without peft: `adapter_config.json` plus
`adapter_model.safetensors` holding `lora_A`/`lora_B` of `q_proj` and `v_proj` in every layer.

Run with the interpreter that has `torch` and `safetensors` (the vLLM venv):
`.venv-vllm/bin/python scripts/build_tiny_lora.py MODEL_DIR OUT_DIR [RANK]`. The key names and config fields are
those PEFT writes (`base_model.model.<module>.lora_A.weight`, shape (r, in); `lora_B`, shape (out, r)) and vLLM's
`PEFTHelper` reads (r, lora_alpha, target_modules).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TARGETS = ("q_proj", "v_proj")


def build(model: Path, out: Path, rank: int = 8, seed: int = 0) -> None:
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    if (out / "adapter_model.safetensors").exists() and (out / "adapter_config.json").exists():
        return  # built already: delete the directory to rebuild
    config = json.loads((model / "config.json").read_text())
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    outputs = {"q_proj": config["num_attention_heads"] * head_dim,
               "v_proj": config["num_key_value_heads"] * head_dim}  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(outputs[module], rank, generator=gen) * 0.02
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit("usage: build_tiny_lora.py MODEL_DIR OUT_DIR [RANK]")
    build(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) == 4 else 8)
