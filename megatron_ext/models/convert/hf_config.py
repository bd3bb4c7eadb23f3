"""Hugging Face `config.json` <-> ModelConfig for the families in `families.py`.

Import reads what transformers reads (its defaults where a key is left out) and refuses, with
one line naming the key, whatever megatron's GPT model space cannot build: other activations,
biases on some linear layers but not others, a sliding window shorter than the sequence, RoPE
scaling other than Llama 3's and YaRN. Export writes the family `families.family_of` picks, with the
context length the model declared (`model.max_position_embeddings`).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from megatron_ext.config.schema import ModelConfig
from megatron_ext.models.convert.families import Family, family, family_of
from megatron_ext.models.convert.llama import head_dim, moe_layers, query_groups
from megatron_ext.models.convert.rope import hf_rope, rope_fields


def _biases(hf_config: Mapping[str, Any], fam: Family) -> dict[str, bool]:
    """megatron biases every linear layer (add_bias_linear) or QKV alone (add_qkv_bias)."""
    if fam.model_type == "qwen2":
        return {"add_qkv_bias": True}
    if fam.model_type in ("qwen3", "qwen3_moe"):
        if hf_config.get("attention_bias"):
            raise ValueError(
                "config.json: attention_bias=true is not supported for Qwen3 (its q, k, v and o are biased but "
                "not its MLP; megatron biases every linear layer or QKV alone)"
            )
        return {}
    if fam.model_type != "llama":
        return {}
    attention, mlp = bool(hf_config.get("attention_bias", False)), bool(hf_config.get("mlp_bias", False))
    if attention != mlp:
        raise ValueError(
            f"config.json: attention_bias={str(attention).lower()} with mlp_bias={str(mlp).lower()} is not supported "
            "(megatron's add_bias_linear biases attention and MLP together)"
        )
    return {"add_bias_linear": attention}


def _window(hf_config: Mapping[str, Any], fam: Family) -> Optional[int]:
    """The sliding window transformers applies to some layer, or None."""
    window = hf_config.get("sliding_window")
    if window is None or fam.model_type == "llama":
        return None
    if fam.model_type in ("mistral", "mixtral"):
        return int(window)
    if not hf_config.get("use_sliding_window", False):
        return None
    layer_types = hf_config.get("layer_types")
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    return int(window) if hf_config["num_hidden_layers"] > hf_config.get("max_window_layers", 28) else None


def _num_experts(hf_config: Mapping[str, Any], default: int) -> int:
    """transformers reads `num_experts` and `num_local_experts` as one attribute in both MoE
    families; a config with both must agree."""
    given = {hf_config[key] for key in ("num_local_experts", "num_experts") if hf_config.get(key) is not None}
    if len(given) > 1:
        raise ValueError(f"config.json: num_local_experts and num_experts disagree ({sorted(given)})")
    return given.pop() if given else default


def _experts(hf_config: Mapping[str, Any], fam: Family) -> dict[str, Any]:
    if fam.model_type == "mixtral":
        return {
            "num_experts": _num_experts(hf_config, 8),
            "moe_router_topk": hf_config.get("num_experts_per_tok", 2),
            "moe_ffn_hidden_size": hf_config["intermediate_size"],
            # Mixtral renormalises its top-k softmax weights: a softmax over the top-k logits.
            "moe_router_pre_softmax": False,
        }
    if fam.model_type != "qwen3_moe":
        return {}
    layers, step = hf_config["num_hidden_layers"], hf_config.get("decoder_sparse_step", 1)
    dense = set(hf_config.get("mlp_only_layers") or [])
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    return {
        "num_experts": _num_experts(hf_config, 128),
        "moe_router_topk": hf_config.get("num_experts_per_tok", 8),
        "moe_ffn_hidden_size": hf_config.get("moe_intermediate_size", 768),
        # norm_topk_prob renormalises the top-k of the softmax (a softmax over the top-k logits);
        # without it the weights are the softmax over all experts (megatron's pre-softmax).
        "moe_router_pre_softmax": not hf_config.get("norm_topk_prob", False),
        "moe_layer_freq": "1" if all(pattern) else str(pattern),
    }


def model_config_from_hf(
    hf_config: Mapping[str, Any], max_seq_length: int = 2048, name: Optional[str] = None
) -> ModelConfig:
    """The ModelConfig of a Hugging Face `config.json`. The sequence length is the model's
    context capped at `max_seq_length` (RoPE needs no learned positions, so a shorter training
    length loses nothing); the context itself is kept as `max_position_embeddings`."""
    fam = family(hf_config.get("model_type"), hf_config.get("architectures") or ())
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act={hf_config['hidden_act']!r} is not supported (silu, i.e. SwiGLU)")
    hidden, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    context = hf_config.get("max_position_embeddings")
    seq_length = min(context or max_seq_length, max_seq_length)
    window = _window(hf_config, fam)
    if window is not None and window < seq_length:
        raise ValueError(
            f"config.json: sliding_window={window} is shorter than the sequence ({seq_length}); megatron's attention "
            f"here has no sliding window (convert with a maximum sequence length of at most {window})"
        )
    head = hf_config.get("head_dim") or fam.head_dim or hidden // heads
    return ModelConfig(
        name=name or hf_config.get("_name_or_path") or fam.model_type,
        num_layers=hf_config["num_hidden_layers"],
        hidden_size=hidden,
        ffn_hidden_size=hf_config["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=hf_config.get("num_key_value_heads") or heads,
        seq_length=seq_length,
        max_position_embeddings=context,
        vocab_size=hf_config["vocab_size"],
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        norm_epsilon=float(hf_config.get("rms_norm_eps", fam.rms_norm_eps)),
        head_dim=head if head != hidden // heads else None,
        qk_layernorm=fam.model_type in ("qwen3", "qwen3_moe"),
        **rope_fields(hf_config, fam.rope_theta),
        **_biases(hf_config, fam),
        **_experts(hf_config, fam),
    )


def _family_keys(cfg: ModelConfig, fam: Family) -> dict[str, Any]:
    """The keys of config.json that only some families have."""
    if fam.model_type == "llama":
        return {"attention_bias": cfg.add_bias_linear, "mlp_bias": cfg.add_bias_linear}
    if fam.model_type == "qwen2":
        return {"use_sliding_window": False}
    if fam.model_type == "qwen3":
        return {"attention_bias": False, "use_sliding_window": False}
    layers = moe_layers(cfg)
    experts = {"num_experts_per_tok": cfg.moe_router_topk}
    if fam.model_type == "mixtral":
        if not all(layers):
            raise ValueError(f"model.moe_layer_freq={cfg.moe_layer_freq!r}: Mixtral has experts in every layer")
        f = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
        return {**experts, "num_local_experts": cfg.num_experts, "intermediate_size": f, "sliding_window": None}
    return {
        **experts,
        "num_experts": cfg.num_experts,
        "moe_intermediate_size": cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
        "norm_topk_prob": not cfg.moe_router_pre_softmax,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, moe in enumerate(layers) if not moe],
        "attention_bias": False,
        "use_sliding_window": False,
    }


def hf_config_from_model(cfg: ModelConfig, vocab_size: int, extra: Optional[Mapping[str, Any]] = None) -> dict:
    """The `config.json` of this model's transformers family (fp32 weights); `extra` adds e.g.
    token ids."""
    fam = family_of(cfg)
    return {
        "architectures": [fam.architecture],
        "model_type": fam.model_type,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": query_groups(cfg),
        "head_dim": head_dim(cfg),
        "vocab_size": vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings or cfg.seq_length,
        "rms_norm_eps": cfg.norm_epsilon,
        **hf_rope(cfg),
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        **_family_keys(cfg, fam),
        "dtype": "float32",
        "torch_dtype": "float32",
        **(extra or {}),
    }
