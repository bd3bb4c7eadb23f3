"""The base's loss over its own TP group: cross entropy of vocab-parallel logits.

Megatron's GPTModel takes its TP group from the `pg_collection` it is built with, except for
its loss: `tensor_parallel.vocab_parallel_cross_entropy` reduces over parallel_state's global
TP group, which is not a pack's when the packs of a sweep run at different TP (groups.py).
`reduce_over_own_group` gives a model a loss that reduces over the model's own group instead:
the softmax's max and sum and the label's logit are reduced over the vocabulary slices, and
autograd derives the backward (megatron's reduce is the identity there, right since every
rank holds the same loss). It takes the logits where megatron's loss does, in megatron's
[s, b] layout: the gradients the base then sees are laid out as with megatron's loss, so a
job's rows stay bitwise independent of its pack partners. Computed in at least fp32, like
megatron's (fp64 models stay fp64).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Per-token losses of `logits` [..., vocab / tp] (this rank's slice of the vocabulary, in
    rank order over `group`, megatron's layout) against `labels` [...]."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    width = logits.shape[-1]
    peak = logits.detach().amax(dim=-1, keepdim=True)  # a constant shift: no gradient through it
    if group.size() > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - peak
    total = _summed(shifted.exp().sum(dim=-1), group)
    index = labels.to(logits.device) - group.rank() * width
    here = (index >= 0) & (index < width)
    picked = shifted.gather(-1, index.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
    target = _summed(torch.where(here, picked, 0.0), group)
    return total.log() - target


def _summed(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    # Megatron's reduce all-reduces a contiguous copy and returns its input: a strided input
    # (labels in another layout than the logits) would come back unreduced.
    return reduce_from_tensor_model_parallel_region(t.contiguous(), group=group)


def reduce_over_own_group(model: GPTModel) -> None:
    """`model(..., labels=...)` returns per-token losses [b, s] reduced over `model.tp_group`."""
    group = model.tp_group

    def loss(labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:  # logits [s, b, vocab / tp]
        return vocab_parallel_cross_entropy(logits, labels.transpose(0, 1), group).transpose(0, 1).contiguous()

    model.compute_language_model_loss = loss
