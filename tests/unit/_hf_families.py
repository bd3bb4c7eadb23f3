"""Tiny random transformers models of every family the converters read, saved with
`save_pretrained` (shared by the unit and distributed family tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# 4 layers (TP2 x PP2 needs 2 per stage), 4 query / 2 KV heads. Weights five times transformers'
# default spread, so that attention scores (and with them RoPE) move the logits.
SIZES = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=100, max_position_embeddings=256, initializer_range=0.1,
)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
MOE = dict(intermediate_size=48, num_experts_per_tok=2)

# name -> (transformers config class name, its arguments besides SIZES)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": ("LlamaConfig", dict(rope_theta=500000.0, rope_scaling=LLAMA3)),
    "llama_bias": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", dict(rope_theta=1e6)),
    # YaRN stretching a 64-token context four times (Qwen2.5's long-context recipe, shrunk).
    "qwen2_yarn": ("Qwen2Config", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})),
    # YaRN with its own ramp and DeepSeek's attention scale (mscale over mscale_all_dim).
    "qwen2_yarn_scaled": (
        "Qwen2Config",
        dict(
            rope_scaling={
                "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.9, "mscale_all_dim": 0.6,
            }
        ),
    ),
    "qwen3": ("Qwen3Config", dict(head_dim=128, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(sliding_window=4096)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, **MOE)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, moe_intermediate_size=32, norm_topk_prob=True, **MOE)),
    "qwen3_moe_softmax": (
        "Qwen3MoeConfig",
        dict(num_experts=4, moe_intermediate_size=32, norm_topk_prob=False, mlp_only_layers=[1], **MOE),
    ),
}


def hf_config(name: str):
    import transformers

    class_name, kwargs = FAMILIES[name]
    return getattr(transformers, class_name)(**{**SIZES, **kwargs})


def save_tiny(name: str, folder: Path, seed: int = 0) -> None:
    """A random model of family `name` in `folder`; norms and biases are drawn too (transformers
    initialises them to ones and zeros, which would hide a swapped or dropped one)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(name))
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "norm" in param_name:
                p.uniform_(0.5, 1.5)
            elif param_name.endswith("bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder)


def hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits[0]
