"""Floating-point operations of one training iteration, as Megatron-LM counts them for
`--log-throughput` (its `num_floating_point_operations`, for GPTModel's decoder).

Every GEMM is counted once forward and twice backward (3x), at 2 operations per multiply-add:
the attention projections (GQA or multi-latent), core attention with the causal half of the
scores, the MLPs (dense, routed experts at top-k, shared experts) and the output layer.
Norms, biases and softmax are left out, as Megatron-LM leaves them out.
"""

from __future__ import annotations

from typing import Optional

from megatron_ext.config.moe_pattern import moe_layer_pattern
from megatron_ext.config.schema import ModelConfig

# forward + backward (weight and data gradients), 2 operations per multiply-add
_GEMM = 3 * 2


def _attention(m: ModelConfig) -> tuple[float, float]:
    """(token-linear, per-token-per-position core) operations of one attention layer."""
    if m.multi_latent_attention:
        qk = m.qk_head_dim + m.qk_pos_emb_head_dim
        heads = m.num_attention_heads
        q = m.hidden_size * heads * qk if m.q_lora_rank is None else m.q_lora_rank * (m.hidden_size + heads * qk + 1)
        kv = m.kv_lora_rank * (m.hidden_size + heads * (m.qk_head_dim + m.v_head_dim) + 1)
        linear = q + kv + m.hidden_size * m.qk_pos_emb_head_dim + heads * m.v_head_dim * m.hidden_size
        core = heads * qk / 2 + heads * m.v_head_dim / 2
        return _GEMM * linear, _GEMM * core
    head_dim = m.head_dim or m.hidden_size // m.num_attention_heads
    query = head_dim * m.num_attention_heads
    key_value = 2 * head_dim * (m.num_query_groups or m.num_attention_heads)
    linear = m.hidden_size * (query + key_value) + query * m.hidden_size
    # QK^T and softmax(QK^T)V, half of each under the causal mask
    return _GEMM * linear, _GEMM * query


def flops_per_iteration(model: ModelConfig, padded_vocab_size: int, global_batch_size: int) -> Optional[float]:
    """Operations of one iteration over `global_batch_size` sequences; None for the hybrid
    (Mamba) stack, which this count does not cover."""
    if model.arch != "gpt":
        return None
    m = model
    gated = 3 if m.activation == "swiglu" else 2  # SwiGLU's up projection is two GEMMs wide
    moe_layers = sum(moe_layer_pattern(m)) if m.num_experts is not None else 0
    dense_layers = m.num_layers - moe_layers
    expert_ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size
    mlp = (
        m.ffn_hidden_size * gated * dense_layers
        + (expert_ffn * m.moe_router_topk + (m.moe_shared_expert_intermediate_size or 0)) * gated * moe_layers
    )
    attn_linear, attn_core = _attention(m)
    tokens = global_batch_size * m.seq_length
    per_token = _GEMM * m.hidden_size * mlp + attn_linear * m.num_layers + _GEMM * m.hidden_size * padded_vocab_size
    return tokens * per_token + global_batch_size * m.seq_length**2 * attn_core * m.num_layers
