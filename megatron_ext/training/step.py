"""One micro-batch forward in Megatron-LM's `forward_step` contract, and the loss reduction.

`forward_step(data_iterator, model)` returns `(output_tensor, loss_func)`; `loss_func` returns
the 3-tuple `(loss_sum, num_tokens, {"lm loss": [loss_sum, num_tokens]})`. With
`calculate_per_token_loss` megatron divides the gradients by the number of tokens of the whole
global batch, so the loss is the same token-weighted mean under every TP/PP/DP layout.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import get_batch_on_this_cp_rank, get_model_config

from megatron_ext.data.sft.packing import attention_mask_of
from megatron_ext.platform.device import current_device


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), mask.sum()])}


def forward_step(data_iterator, model):
    device = current_device()
    batch = {k: v.to(device, non_blocking=True) for k, v in next(data_iterator).items()}
    batch = get_batch_on_this_cp_rank(batch)  # this rank's two chunks of each sequence (cp > 1)
    # Multi-token prediction masks its own losses with the batch's loss mask (as in Megatron-LM).
    mtp = {"loss_mask": batch["loss_mask"]} if get_model_config(model).mtp_num_layers else {}
    # Packed conversations attend within themselves only (data/sft/packing.py).
    output = model(batch["tokens"], batch["position_ids"], attention_mask_of(batch), labels=batch["labels"], **mtp)
    return output, partial(loss_func, batch["loss_mask"])


def step_loss(losses: list[dict]) -> Optional[torch.Tensor]:
    """This rank's [loss sum, tokens] of a step over its micro-batches, left on the device (no
    host sync); None off the last pipeline stage (the others have no loss)."""
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    total = losses[0]["lm loss"].float().clone()
    for entry in losses[1:]:
        total += entry["lm loss"].float()
    return total


class PendingLosses:
    """Step losses kept where the last pipeline stage computed them until they are read: one
    reduction over the data-parallel group (and, with pipeline stages, one broadcast from the
    last) for all the steps since the last read, as Megatron-LM's training_log reads its losses once per log interval. On a GPU each
    read is a host sync, so the Trainer reads on log steps (and where something needs every
    step's loss, `Trainer._reads_loss_at`)."""

    def __init__(self) -> None:
        self._steps: list[tuple[int, Optional[torch.Tensor]]] = []
        self._last_read: dict[int, Optional[torch.Tensor]] = {}  # this rank's own, of the last read

    def add(self, iteration: int, local: Optional[torch.Tensor]) -> None:
        self._steps.append((iteration, local))

    def clear(self) -> None:
        self._steps.clear()

    def read(self) -> dict[int, float]:
        """The token-weighted mean loss of each pending step over its global batch, by iteration,
        on every rank. Collective: every rank calls it with the same steps pending."""
        if not self._steps:
            return {}
        iterations = [iteration for iteration, _ in self._steps]
        values = torch.zeros(len(iterations), dtype=torch.float64, device=current_device())
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            totals = torch.stack([local for _, local in self._steps])
            dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            if dist.get_world_size(dp_group) > 1:
                dist.all_reduce(totals, group=dp_group)
            values.copy_(totals[:, 0] / totals[:, 1].clamp(min=1))
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:  # else every rank is on the last stage
            dist.broadcast(values, src=dist.get_world_size() - 1)  # the last rank is on the last stage
        self._last_read = dict(self._steps)
        self._steps.clear()
        return dict(zip(iterations, values.tolist()))

    def finite_on_this_rank(self, iteration: int) -> bool:
        """Whether this rank's own loss of a step of the last read was finite (True off the last
        stage, which has none)."""
        local = self._last_read.get(iteration)
        return local is None or bool(torch.isfinite(local).all())


def global_mean_loss(losses: list[dict]) -> float:
    """One step's token-weighted mean loss over its global batch, on every rank (collective)."""
    pending = PendingLosses()
    pending.add(0, step_loss(losses))
    return pending.read()[0]
