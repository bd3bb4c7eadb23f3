"""Activation-based importance of every axis's units from a calibration pass (forward only).

Each axis scores its own units through forward hooks (`Axis.observe`): embedding channels by the
magnitude of the normalized residual stream, FFN neurons by their post-activation magnitude,
attention heads by the L2 norm of their output (the input of linear_proj), Mamba heads and head
channels, MoE experts by router-weighted output norm (their adapters). The scores are summed
over the data-parallel replicas so every replica ranks (and later permutes) alike.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from megatron_ext.elastic.axes import Axis, reduce_scores


@torch.no_grad()
def calibrate(axes: list[Axis], batches: Iterable, forward: Callable[[object], object], group=None) -> None:
    """Run `forward(batch)` over `batches` with every axis observing, at full width."""
    for axis in axes:
        axis.activate(axis.full)
        axis.score.zero_()
    handles = [h for axis in axes for h in axis.observe()]
    try:
        for batch in batches:
            forward(batch)
    finally:
        for h in handles:
            h.remove()
    reduce_scores(axes, group)
