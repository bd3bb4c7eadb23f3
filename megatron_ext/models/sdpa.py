"""torch's `scaled_dot_product_attention` as the math of megatron's local core attention.

megatron-core's local `DotProductAttention` computes attention as Megatron did before fused
kernels: a `baddbmm` of scores into a [b·heads, s, s] buffer, a masked softmax, a `bmm` with the
values, and a copy back to [s, b, heads·d]. torch's SDPA computes the same function (softmax of
scaled scores, causal by position) in one kernel that never materialises the scores: on CPU its
flash kernel, on CUDA flash or memory-efficient attention. The results agree to rounding.

SDPA serves the cases whose meaning it has exactly; everything else keeps megatron's math
(`sdpa_applies` says which): attention-probability dropout while training (megatron draws it from
its model-parallel RNG tracker), softmax offsets (gpt-oss), sliding windows, query-key layer
scaling, and masks that come with the batch (a packed or padded sample can have a query that sees
no key, where megatron's softmax is uniform and SDPA's is undefined).
"""

from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from torch import Tensor

# Megatron-LM's --attention-backend values that keep megatron's local DotProductAttention math;
# the others (auto, flash, fused) pick a kernel, which on local layers is SDPA.
UNFUSED_BACKENDS = ("unfused", "local")


def sdpa_applies(core, *batch_inputs: Optional[object]) -> bool:
    """Whether SDPA computes exactly what megatron's `DotProductAttention` `core` computes, given
    the batch's mask, attention bias and packed-sequence parameters (all must be absent)."""
    config = core.config
    return (
        all(given is None for given in batch_inputs)
        and config.softmax_type == "vanilla"
        and config.window_size is None
        and not config.apply_query_key_layer_scaling
        and (core.attention_dropout.p == 0.0 or not core.training)
    )


def sdpa_attention(
    query: Tensor, key: Tensor, value: Tensor, scale: float, causal: bool, hidden_mask: Optional[Tensor] = None
) -> Tensor:
    """Attention over megatron's [s, b, heads, d] tensors, returned as [s_q, b, heads·d_v].

    Key/value heads may be fewer than query heads (grouped-query attention: query head h reads
    key head h // (heads / groups), as megatron's `repeat_interleave` pairs them). `hidden_mask`
    is megatron's convention, True where a query may not see a key."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=None if hidden_mask is None else ~hidden_mask,
        is_causal=causal and hidden_mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
