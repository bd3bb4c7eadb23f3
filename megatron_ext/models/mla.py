"""Multi-latent attention (DeepSeek-V2/V3) on megatron-core's local layers.

megatron-core 0.16's MLASelfAttention gives its core attention the head sizes of queries/keys
(`qk_head_dim + qk_pos_emb_head_dim`) and of values (`v_head_dim`), which differ; only
Transformer Engine's attention takes them. Megatron's local `DotProductAttention` works with
any query/key size already (the scores contract whatever size q and k have, and MLA passes its
own softmax scale); it only sizes its output from `kv_channels`. `MLACoreAttention` is that
attention (through `ContextParallelAttention`, the project's local core attention) with the
output sized by the value heads.
"""

from __future__ import annotations

from typing import Optional

from megatron_ext.models.context_parallel import ContextParallelAttention


class MLACoreAttention(ContextParallelAttention):
    """megatron's local core attention, called as MLASelfAttention calls Transformer Engine's
    (megatron's Attention base class first builds it plainly, then MLA again with its sizes)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        sdpa: bool = False,
    ):
        super().__init__(
            config,
            layer_number,
            attn_mask_type,
            attention_type,
            attention_dropout,
            softmax_scale,
            cp_comm_type,
            pg_collection,
            sdpa,
        )
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
