"""Held-out loss and perplexity through megatron's forward-only schedule (any TP/PP/DP layout).

The trainer's periodic evaluation and `perplexity()` of a text both run here: micro-batches go
through `get_forward_backward_func()` with `forward_only=True`, and the loss is the token-weighted
mean over every micro-batch and data-parallel replica, known to every rank.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator, Optional, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_ext.training.step import forward_step, global_mean_loss


@torch.no_grad()
def forward_only_loss(
    model_chunks: list,
    data_iterator,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_backward_func: Optional[Callable] = None,
) -> float:
    """Mean loss per token of `num_microbatches` micro-batches, on every rank."""
    for m in model_chunks:
        m.eval()
    try:
        losses = (forward_backward_func or get_forward_backward_func())(
            forward_step_func=forward_step,
            data_iterator=data_iterator,
            model=model_chunks,
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=True,
        )
    finally:
        for m in model_chunks:
            m.train()
    return global_mean_loss(losses)


def text_windows(ids: Sequence[int], seq_length: int) -> list[dict[str, torch.Tensor]]:
    """Non-overlapping windows of `seq_length` predictions each (the last may be shorter,
    padded and masked out of the loss), as one-sample batches."""
    windows = []
    for start in range(0, max(len(ids) - 1, 0), seq_length):
        chunk = list(ids[start : start + seq_length + 1])
        n = len(chunk) - 1
        pad = seq_length - n
        tokens = torch.tensor(chunk[:-1] + [0] * pad)
        labels = torch.tensor(chunk[1:] + [0] * pad)
        mask = torch.cat([torch.ones(n), torch.zeros(pad)])
        windows.append(
            {
                "tokens": tokens[None],
                "labels": labels[None],
                "loss_mask": mask[None],
                "position_ids": torch.arange(seq_length)[None],
            }
        )
    return windows


def perplexity(model_chunks: list, ids: Sequence[int], seq_length: int) -> float:
    """exp(mean negative log-likelihood per predicted token) of a token sequence. Each
    data-parallel replica scores its share of the windows."""
    windows = text_windows(ids, seq_length)
    if not windows:
        raise ValueError("perplexity: the text has fewer than two tokens")
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    share = windows[dp_rank::dp_size] or [_fully_masked(windows[0])]
    iterators = _per_chunk(share, len(model_chunks))
    return math.exp(forward_only_loss(model_chunks, iterators, len(share), seq_length, 1))


def _fully_masked(batch: dict) -> dict:
    """A replica with no window of its own still takes part in the collective, weighing 0."""
    return {**batch, "loss_mask": torch.zeros_like(batch["loss_mask"])}


def _per_chunk(batches: list[dict], chunks: int):
    iterators: list[Iterator] = [iter(batches) for _ in range(chunks)]
    return iterators if chunks > 1 else iterators[0]
