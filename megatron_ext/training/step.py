"""One micro-batch forward in Megatron-LM's `forward_step` contract, and the loss reduction.

`forward_step(data_iterator, model)` returns `(output_tensor, loss_func)`; `loss_func` returns
the 3-tuple `(loss_sum, num_tokens, {"lm loss": [loss_sum, num_tokens]})`. With
`calculate_per_token_loss` megatron divides the gradients by the number of tokens of the whole
global batch, so the loss is the same token-weighted mean under every TP/PP/DP layout.
"""

from __future__ import annotations

from functools import partial

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


def reduce_loss(losses: list[dict]) -> float | None:
    """Token-weighted mean loss of a step over its micro-batches and data-parallel replicas.
    Non-None on the last pipeline stage only (the others have no loss)."""
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    total = torch.zeros(2)
    for entry in losses:
        total += entry["lm loss"].float().cpu()
    dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(dp_group) > 1:
        total_dev = total.to(current_device())
        dist.all_reduce(total_dev, group=dp_group)
        total = total_dev.cpu()
    return (total[0] / total[1].clamp(min=1)).item()


def broadcast_from_last_rank(value: float | None) -> float:
    """Every rank learns a value only the last pipeline stage has (the last rank is on it)."""
    t = torch.tensor([value if value is not None else 0.0], dtype=torch.float64, device=current_device())
    dist.broadcast(t, src=dist.get_world_size() - 1)
    return t.item()
