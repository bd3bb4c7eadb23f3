"""Multi-token prediction's losses of a step, as Megatron-LM logs them (`mtp_1 loss`, ...).

The MTP layers add their loss to the gradients inside megatron's GPTModel (scaled by
`mtp_loss_scaling_factor`); the step's reported `loss` stays the next-token loss. Each MTP layer's
per-token loss is kept in megatron's `MTPLossLoggingHelper` tracker, summed over micro-batches
on the last pipeline stage: here it is averaged over micro-batches and data-parallel replicas,
as Megatron-LM's training log does, and handed to every rank. Under context parallelism that
average is of each rank's own per-token mean, as in Megatron-LM (the rolled loss mask leaves the
ranks unequal token counts), so the logged value may differ slightly from one rank's; the
gradients do not.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from megatron_ext.platform.device import current_device


def reset_mtp_tracker() -> None:
    """Forget losses (and the layer count) of an earlier model in this process."""
    MTPLossLoggingHelper.tracker.clear()


def mtp_losses(mtp_num_layers: int, num_microbatches: int) -> dict[str, float]:
    """`mtp_k loss` of the step just run, for k = 1 .. mtp_num_layers, on every rank."""
    values = torch.zeros(mtp_num_layers, device=current_device())
    tracker = MTPLossLoggingHelper.tracker
    if "values" in tracker:  # the stage that holds the MTP layers
        MTPLossLoggingHelper.reduce_loss_in_tracker()
        values.copy_(tracker["values"] / num_microbatches)
        MTPLossLoggingHelper.clean_loss_in_tracker()
    # The last rank is on the last pipeline stage.
    dist.broadcast(values, src=dist.get_world_size() - 1)
    return {f"mtp_{k + 1} loss": value for k, value in enumerate(values.tolist())}
