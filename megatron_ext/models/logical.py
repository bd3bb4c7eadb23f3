"""Logical (layout-free) tensors of a megatron model, read from its own sharded state dict.

Megatron's `sharded_state_dict()` says, for every tensor a rank holds, which logical tensor it
belongs to (a key like `decoder.layers.self_attention.linear_qkv.weight` plus the global layer
index) and which box of it this rank holds. That metadata is the single truth used here to put
whole tensors into any TP/PP/VPP layout — random initial weights, or a pretrained checkpoint —
without re-deriving megatron's sharding rules (fused QKV order, SwiGLU halves, vocab slices).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
from megatron.core.utils import unwrap_model


@dataclass(frozen=True)
class LogicalName:
    """One logical tensor: its sharded-state-dict key and, for per-layer (and per-expert)
    tensors, the global indices megatron prepends to its shape."""

    key: str
    index: tuple[int, ...] = ()

    @property
    def layer(self) -> Optional[int]:
        return self.index[0] if self.index else None


def local_shards(
    model_chunks: list, metadata: Optional[dict] = None
) -> Iterator[tuple[LogicalName, torch.Size, ShardedTensor]]:
    """Every tensor shard this rank holds: (logical name, logical shape, shard). `metadata` goes
    to megatron's `sharded_state_dict` (e.g. explicit groups of a layout that is not running)."""
    for chunk in model_chunks:
        state = unwrap_model(chunk).sharded_state_dict(metadata=metadata)
        apply_factories(state)  # e.g. SwiGLU's fc1 becomes its two halves
        for sh in nested_values(state):
            if isinstance(sh, ShardedTensor) and sh.data is not None:
                n = sh.prepend_axis_num
                yield LogicalName(sh.key, tuple(sh.global_offset[:n])), torch.Size(sh.global_shape[n:]), sh


def local_box(sh: ShardedTensor) -> tuple[slice, ...]:
    """This shard's box in its logical tensor."""
    offsets = sh.global_offset[sh.prepend_axis_num :]
    return tuple(slice(o, o + n) for o, n in zip(offsets, sh.local_shape))


@torch.no_grad()
def fill_from_logical(
    model_chunks: list, source: Callable[[LogicalName, torch.Size], Optional[torch.Tensor]]
) -> None:
    """Copy into every local shard its box of `source(name, shape)`; None leaves a shard as is.
    `source` is called once per shard, so it should be cheap to call again for the same name
    (SwiGLU halves and tied embeddings ask twice)."""
    for name, shape, sh in local_shards(model_chunks):
        full = source(name, shape)
        if full is None:
            continue
        if full.shape != shape:
            raise ValueError(f"{name.key}{list(name.index)}: expected shape {tuple(shape)}, got {tuple(full.shape)}")
        sh.data.copy_(full[local_box(sh)].view(sh.data.shape))
