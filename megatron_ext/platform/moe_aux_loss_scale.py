"""megatron's MoE aux-loss scale, a process-global shaped by its first user.

`MoEAuxLossAutoScaler.main_loss_backward_scale` is set by the first backward through an MoE
router (a tensor of that backward's shape and device) and later only copied into by
`set_loss_scale`. A backward outside megatron's schedules (a memory probe, a previous trainer in
the same process) leaves a shape the schedules then cannot copy into; megatron has no public
reset, so the class attribute is read and written here (checked with the megatron-core of
`versions.CHECKED["moe_aux_loss_scale"]`).
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler


def aux_loss_scale() -> Optional[torch.Tensor]:
    """The scale now (None before any MoE backward)."""
    return MoEAuxLossAutoScaler.main_loss_backward_scale


def set_aux_loss_scale(scale: Optional[torch.Tensor]) -> None:
    """Put `scale` back (None: the next MoE backward shapes it anew)."""
    MoEAuxLossAutoScaler.main_loss_backward_scale = scale
