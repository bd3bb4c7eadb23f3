"""The transformers model families that megatron's GPT model space holds, and which one a model
of that space is when it is written back out.

Llama, Mistral, Qwen2, Qwen3, Mixtral and Qwen3-MoE share one decoder layout (pre-norm RMSNorm,
SwiGLU, RoPE with rotate_half, GQA, the same q/k/v/o and gate/up/down tensor names); they differ
in biases, QK-norm, experts and the names of the expert tensors. The family of a megatron model
is a function of its ModelConfig, so an export needs nothing but the checkpoint: a model with
QK-norm is Qwen3 (Qwen3-MoE with experts), one with a bias on QKV alone is Qwen2, experts without
QK-norm are Mixtral, anything else Llama (Mistral without a sliding window is Llama's network).
A setting that changes what the model computes and that none of them has (multi-token prediction
layers, a sliding window within the context, softmax offsets, multi-latent attention, ...) is
refused with the family the model would otherwise be, never dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from megatron_ext.config.schema import ModelConfig


@dataclass(frozen=True)
class ExpertNames:
    """Hugging Face names of one MoE layer's tensors; {i} is the layer, {e} the expert."""

    router: str
    gate: str
    up: str
    down: str


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str
    # transformers' defaults for keys a config.json may leave out.
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    # None: hidden_size // num_attention_heads.
    head_dim: Optional[int] = None
    experts: Optional[ExpertNames] = None


MIXTRAL_EXPERTS = ExpertNames(
    router="model.layers.{i}.block_sparse_moe.gate.weight",
    gate="model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
    up="model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
    down="model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",
)
QWEN3_MOE_EXPERTS = ExpertNames(
    router="model.layers.{i}.mlp.gate.weight",
    gate="model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
    up="model.layers.{i}.mlp.experts.{e}.up_proj.weight",
    down="model.layers.{i}.mlp.experts.{e}.down_proj.weight",
)

FAMILIES = {
    f.model_type: f
    for f in (
        Family("llama", "LlamaForCausalLM"),
        Family("mistral", "MistralForCausalLM"),
        Family("qwen2", "Qwen2ForCausalLM"),
        Family("qwen3", "Qwen3ForCausalLM", head_dim=128),
        Family("mixtral", "MixtralForCausalLM", rope_theta=1e6, rms_norm_eps=1e-5, experts=MIXTRAL_EXPERTS),
        Family("qwen3_moe", "Qwen3MoeForCausalLM", experts=QWEN3_MOE_EXPERTS),
    )
}


def family(model_type: Optional[str], architectures: Sequence[str] = ()) -> Family:
    """The family of a config.json's `model_type`; `architectures` (its classes) named too when
    it is none of them."""
    if model_type not in FAMILIES:
        named = f" (architectures: {', '.join(architectures)})" if architectures else ""
        supported = ", ".join(f"{f.architecture} ({f.model_type})" for f in FAMILIES.values())
        raise ValueError(f"config.json: model_type={model_type!r} is not supported{named}; the supported: {supported}")
    return FAMILIES[model_type]


def _windowed(cfg: ModelConfig) -> bool:
    """Whether some layer's sliding window hides keys within the model's context (a query at
    position i sees keys i-L .. i; every N-th layer of window_attn_skip_freq N attends fully)."""
    if cfg.window_size is None or cfg.window_attn_skip_freq == 1:
        return False
    return cfg.window_size[0] + 1 < (cfg.max_position_embeddings or cfg.seq_length)


def _outside_families(cfg: ModelConfig) -> list[str]:
    """Model-space settings that none of these families has (each with what they have)."""
    checks = [
        (cfg.arch != "gpt", f"model.arch={cfg.arch!r} (gpt)"),
        (cfg.normalization != "RMSNorm", f"model.normalization={cfg.normalization!r} (RMSNorm)"),
        (cfg.activation != "swiglu", f"model.activation={cfg.activation!r} (swiglu)"),
        (cfg.glu_linear_offset != 0.0, f"model.glu_linear_offset={cfg.glu_linear_offset} (0)"),
        (cfg.activation_func_clamp_value is not None, f"model.activation_func_clamp_value={cfg.activation_func_clamp_value} (None)"),
        (
            cfg.position_embedding_type not in ("rope", "yarn"),
            f"model.position_embedding_type={cfg.position_embedding_type!r} (rope or yarn)",
        ),
        (cfg.rotary_percent != 1.0, f"model.rotary_percent={cfg.rotary_percent} (1.0)"),
        (
            _windowed(cfg),
            f"model.window_size={list(cfg.window_size or [])} shorter than the context of "
            f"{cfg.max_position_embeddings or cfg.seq_length} (no window)",
        ),
        (cfg.softmax_type != "vanilla", f"model.softmax_type={cfg.softmax_type!r} (vanilla)"),
        (cfg.mtp_num_layers is not None, f"model.mtp_num_layers={cfg.mtp_num_layers} (None: no multi-token prediction)"),
        (cfg.multi_latent_attention, "model.multi_latent_attention=true (false)"),
        (cfg.moe_shared_expert_intermediate_size is not None, "model.moe_shared_expert_intermediate_size (None)"),
        (cfg.moe_router_score_function != "softmax", f"model.moe_router_score_function={cfg.moe_router_score_function!r} (softmax)"),
        (cfg.moe_router_enable_expert_bias, "model.moe_router_enable_expert_bias=true (false)"),
        (cfg.moe_router_num_groups is not None, "model.moe_router_num_groups (None)"),
        (cfg.moe_router_topk_scaling_factor is not None, "model.moe_router_topk_scaling_factor (None)"),
        (
            cfg.moe_router_load_balancing_type == "sinkhorn",
            "model.moe_router_load_balancing_type='sinkhorn' (top-k routing)",
        ),
        (cfg.moe_router_force_load_balancing, "model.moe_router_force_load_balancing=true (routing by the router's logits)"),
    ]
    return [what for bad, what in checks if bad]


def family_of(cfg: ModelConfig) -> Family:
    """The transformers family whose network this ModelConfig is; raises, naming the fields and
    the family the model would otherwise be written as, where none is: an export never drops a
    setting that changes what the model computes."""
    fam = _nearest_family(cfg)
    outside = _outside_families(cfg)
    if outside:
        raise ValueError(
            f"no transformers family has {'; '.join(outside)} (what the families have in brackets): "
            f"the model cannot be written as {fam.architecture}"
        )
    return fam


def _nearest_family(cfg: ModelConfig) -> Family:
    """The family that biases, QK-norm and experts choose; raises for their mixes none has."""
    moe = cfg.num_experts is not None
    if cfg.qk_layernorm:
        if cfg.add_bias_linear or cfg.add_qkv_bias:
            raise ValueError(
                "model.qk_layernorm with model.add_bias_linear or model.add_qkv_bias has no transformers family "
                "(Qwen3's attention bias covers q, k, v and o, its MLP has none)"
            )
        return FAMILIES["qwen3_moe" if moe else "qwen3"]
    if moe:
        if cfg.add_qkv_bias or cfg.add_bias_linear:
            raise ValueError("model.add_bias_linear / add_qkv_bias with experts has no transformers family (Mixtral has no biases)")
        if cfg.moe_router_pre_softmax:
            raise ValueError(
                "model.moe_router_pre_softmax with experts and without model.qk_layernorm has no transformers family "
                "(Mixtral renormalises its top-k weights)"
            )
        return FAMILIES["mixtral"]
    if cfg.add_qkv_bias and not cfg.add_bias_linear:
        return FAMILIES["qwen2"]
    return FAMILIES["llama"]
