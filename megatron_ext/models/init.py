"""Weight initialisation that does not depend on the parallel layout.

Megatron draws each layer's weights from the rank's generator in construction order, so a
pipeline stage that builds layers 3-4 draws different numbers than a single rank that built
layers 1-2 first: TP=1 and PP=2 start from different models. Here every logical tensor is drawn
from its own generator, seeded by (run seed, its key, its layer index), and each rank copies out
the box it holds (see `logical.py`). Any layout therefore starts from the identical model, which
is what makes loss curves of different layouts comparable and lets a reshard be checked against a
single-rank run.

The cost is megatron's own `use_cpu_initialization` cost: each rank materialises, one tensor at
a time, the full weight of the layers it holds.
"""

from __future__ import annotations

import hashlib
import math
from typing import Optional

import torch
from megatron.core.transformer import TransformerConfig

from megatron_ext.config.schema import ModelConfig
from megatron_ext.models import mamba2
from megatron_ext.models.logical import LogicalName, fill_from_logical

# Weights megatron initialises with `output_layer_init_method` (std / sqrt(2 * num_layers)):
# the projections that write into the residual stream.
_RESIDUAL_OUTPUT_PROJECTIONS = ("linear_proj.weight", "linear_fc2.weight", "mixer.out_proj.weight")


def layout_independent(model: ModelConfig, on_cpu: bool) -> bool:
    """Whether the run's weights are drawn layout-independently (`model.layout_independent_init`,
    by default on the CPU only)."""
    return on_cpu if model.layout_independent_init is None else model.layout_independent_init


def _init_std(key: str, config: TransformerConfig) -> Optional[float]:
    """The normal std megatron uses for this weight, or None for deterministic ones (norms)."""
    if key.endswith("softmax_offset"):
        # Learnable attention sinks, one per head: megatron draws them with init_method.
        return config.init_method_std
    if "norm" in key or not key.endswith("weight"):
        return None
    if key.endswith(_RESIDUAL_OUTPUT_PROJECTIONS):
        return config.init_method_std / math.sqrt(2.0 * config.num_layers)
    return config.init_method_std


def _seed(seed: int, name: LogicalName) -> int:
    digest = hashlib.sha256(f"{seed}/{name.key}/{name.index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_weights_layout_independent(model_chunks: list, config: TransformerConfig, seed: int) -> None:
    def draw(name: LogicalName, shape: torch.Size) -> Optional[torch.Tensor]:
        std = _init_std(name.key, config)
        generator = torch.Generator().manual_seed(_seed(seed, name))
        mixer_tensor = mamba2.logical_init(name.key, shape, generator, config.init_method_std)
        if mixer_tensor is not None:
            return mixer_tensor
        if std is None:
            return None
        return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)

    fill_from_logical(model_chunks, draw)
