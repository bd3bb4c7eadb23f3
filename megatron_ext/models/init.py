"""Weight initialisation that does not depend on the parallel layout.

Megatron draws each layer's weights from the rank's generator in construction order, so a
pipeline stage that builds layers 3-4 draws different numbers than a single rank that built
layers 1-2 first: TP=1 and PP=2 start from different models. Here every logical tensor is drawn
from its own generator, seeded by (run seed, the tensor's key in megatron's sharded state dict,
its layer index), and each rank copies out the box it holds according to that same metadata.
Any layout therefore starts from the identical model, which is what makes loss curves of
different layouts comparable and lets a reshard be checked against a single-rank run.

The cost is megatron's own `use_cpu_initialization` cost: each rank materialises, one tensor at
a time, the full weight of the layers it holds.
"""

from __future__ import annotations

import hashlib
import math

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
from megatron.core.transformer import TransformerConfig

# Weights megatron initialises with `output_layer_init_method` (std / sqrt(2 * num_layers)):
# the projections that write into the residual stream.
_RESIDUAL_OUTPUT_PROJECTIONS = ("linear_proj.weight", "linear_fc2.weight")


def _init_std(key: str, config: TransformerConfig) -> float | None:
    """The normal std megatron uses for this weight, or None for deterministic ones (norms)."""
    if "norm" in key or not key.endswith("weight"):
        return None
    if key.endswith(_RESIDUAL_OUTPUT_PROJECTIONS):
        return config.init_method_std / math.sqrt(2.0 * config.num_layers)
    return config.init_method_std


def _seed(seed: int, key: str, layer_offset: tuple[int, ...]) -> int:
    digest = hashlib.sha256(f"{seed}/{key}/{layer_offset}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _local_box(sh: ShardedTensor) -> tuple[slice, ...]:
    offsets = sh.global_offset[sh.prepend_axis_num :]
    return tuple(slice(o, o + n) for o, n in zip(offsets, sh.local_shape))


@torch.no_grad()
def init_weights_layout_independent(model_chunks: list, config: TransformerConfig, seed: int) -> None:
    for chunk in model_chunks:
        state = chunk.sharded_state_dict()
        apply_factories(state)
        for sh in nested_values(state):
            if not isinstance(sh, ShardedTensor) or sh.data is None:
                continue
            std = _init_std(sh.key, config)
            if std is None:
                continue
            layer_offset = tuple(sh.global_offset[: sh.prepend_axis_num])
            generator = torch.Generator().manual_seed(_seed(seed, sh.key, layer_offset))
            shape = sh.global_shape[sh.prepend_axis_num :]
            full = torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
            sh.data.copy_(full[_local_box(sh)].view(sh.data.shape))
