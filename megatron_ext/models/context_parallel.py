"""Context parallelism for megatron-core's local layers, where Transformer Engine is absent.

megatron-core 0.16 gives context parallelism (CP) to Transformer Engine's attention only; its
local `DotProductAttention` refuses `context_parallel_size > 1`. Everything else CP needs is in
megatron already and is used as is: the load-balanced split of each sequence into 2·cp chunks
(`get_batch_on_this_cp_rank`: rank r holds chunks r and 2·cp−1−r), RoPE at each chunk's global
positions, and the gradient reduction over the data-and-context-parallel group.

`ContextParallelAttention` is megatron's `DotProductAttention` (same numerics: scaling, GQA,
masked softmax, dropout) over the whole sequence's keys and values: each rank all-gathers K/V
from its CP peers (an all-gather CP, as Llama 3 trains long contexts with) and masks causally by
global position. Memory for K/V grows with the whole sequence, which is the price of not
ring-passing blocks; the queries, the scores and everything outside attention stay local.

With `sdpa=True` (the local layer spec's choice unless `model.attention_backend` asks for
megatron's unfused math) the attention itself is torch's SDPA wherever it computes the same
function (models/sdpa.py), with or without CP.
"""

from __future__ import annotations

import copy
import functools
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor

from megatron_ext.models.sdpa import sdpa_applies, sdpa_attention


def chunk_positions(seq_len: int, cp: int, rank: int) -> Tensor:
    """Global token positions rank `rank` of `cp` holds: its chunks r and 2·cp−1−r, in order."""
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)
    return torch.cat([first, second])


@functools.lru_cache(maxsize=16)
def _global_order(cp: int, chunk: int) -> Tensor:
    """Index that turns the rank-ordered gather (rank 0's two chunks, rank 1's, ...) into the
    sequence order. Cached: every attention layer of every step asks for the same few (the
    tensor is only read)."""
    gathered = torch.cat([chunk_positions(2 * cp * chunk, cp, r) for r in range(cp)])
    return torch.argsort(gathered)


class _GatherSequence(torch.autograd.Function):
    """All-gather a [s_local, ...] tensor over the CP group into [s, ...] in sequence order.

    Backward sums every rank's gradient of the whole sequence and keeps this rank's chunks. An
    all-reduce rather than a reduce-scatter: gloo has no reduce-scatter, and this path is for
    machines without Transformer Engine, where simplicity beats the extra bytes."""

    @staticmethod
    def forward(ctx, local: Tensor, group: dist.ProcessGroup) -> Tensor:
        cp, rank = group.size(), group.rank()
        parts = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(parts, local.contiguous(), group=group)
        order = _global_order(cp, local.shape[0] // 2).to(local.device)
        ctx.group, ctx.mine = group, chunk_positions(cp * local.shape[0], cp, rank).to(local.device)
        return torch.cat(parts).index_select(0, order)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.index_select(0, ctx.mine), None


class ContextParallelAttention(DotProductAttention):
    """Drop-in for megatron's local `DotProductAttention` (same constructor and forward) under
    context parallelism; see the module docstring. With cp = 1 it is that attention unchanged, so
    the project's local layer spec always uses it."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        sdpa: bool = False,
    ):
        if config.window_size is not None and config.context_parallel_size > 1:
            raise ValueError("context parallelism on local layers has no sliding-window attention")
        # The parent refuses a CP config; it only reads the TP sizes and softmax settings from it.
        local = copy.copy(config)
        local.context_parallel_size = 1
        super().__init__(
            local, layer_number, attn_mask_type, attention_type, attention_dropout, softmax_scale,
            cp_comm_type, pg_collection,
        )
        self.config = config
        self.sdpa = sdpa
        cp_group = getattr(pg_collection, "cp", None)
        self.cp_group = cp_group or parallel_state.get_context_parallel_group(check_initialized=False)
        self._masks: dict[tuple[int, torch.device], Tensor] = {}

    def _causal_mask(self, seq_len: int, device: torch.device) -> Tensor:
        """[1, 1, s_local, s] True where a local query may not see a key (a later position)."""
        key = (seq_len, device)
        if key not in self._masks:
            cp, rank = self.cp_group.size(), self.cp_group.rank()
            queries = chunk_positions(seq_len, cp, rank)
            self._masks[key] = (torch.arange(seq_len)[None, :] > queries[:, None])[None, None].to(device)
        return self._masks[key]

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type=None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params=None,
    ) -> Tensor:
        batch_inputs = (attention_mask, attention_bias, packed_seq_params)
        if self.cp_group is None or self.cp_group.size() == 1:
            causal = self.attn_mask_type == AttnMaskType.causal
            # megatron's causal mask is square: its queries and keys are the same positions.
            if self.sdpa and sdpa_applies(self, *batch_inputs) and (not causal or query.shape[0] == key.shape[0]):
                return sdpa_attention(query, key, value, self.softmax_scale, causal)
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        if attention_mask is not None or packed_seq_params is not None:
            raise ValueError("context parallelism on local layers supports plain causal attention only")
        key = _GatherSequence.apply(key, self.cp_group)
        value = _GatherSequence.apply(value, self.cp_group)
        mask = self._causal_mask(key.shape[0], query.device)
        if self.sdpa and sdpa_applies(self, *batch_inputs):
            return sdpa_attention(query, key, value, self.softmax_scale, causal=True, hidden_mask=mask)
        return super().forward(query, key, value, mask, attn_mask_type, attention_bias, packed_seq_params)
