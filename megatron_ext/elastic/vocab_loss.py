"""Distillation and next-token losses on vocabulary-parallel logits.

Under tensor parallelism megatron's output layer leaves each TP rank the logits of its block of
the (padded) vocabulary, so a softmax needs the whole row: the maximum and the partition sum are
reduced over the TP group. Both losses come out as the same [b, s] tensor on every TP rank, with
the gradient of each rank's logit block (at TP=1 the reductions are skipped; the arithmetic is
the same). Entries of the padded vocabulary beyond `vocab` are left out, as the TP=1 code did.

Gradients: a loss is a sum over the vocabulary blocks of per-block terms, summed with megatron's
`reduce_from_tensor_model_parallel_region` (forward all-reduce, backward identity: each rank
differentiates its own terms). The partition sum Z is an all-reduce whose backward is an
all-reduce too (megatron's `copy_to_...` then `reduce_from_...`), so d loss / d z_r collects every rank's terms; for that to be the gradient of
one loss, log Z must enter the per-block terms with weights that sum to one over the ranks (the
teacher's probabilities of the block in KL; the label's indicator in cross entropy).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)


def _tp() -> tuple[int, int]:
    return parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()


def real_block(logits: torch.Tensor, vocab: int) -> tuple[torch.Tensor, int]:
    """This rank's logits of real (not padded) tokens, as fp32 at least, and the global index of
    its first vocabulary entry."""
    _, rank = _tp()
    per = logits.shape[-1]
    start = rank * per
    real = min(per, max(0, vocab - start))
    return logits[..., :real].to(torch.promote_types(logits.dtype, torch.float32)), start


def log_partition(x: torch.Tensor) -> torch.Tensor:
    """log sum exp over the whole vocabulary row of the blocks `x` ([..., V_local] -> [...])."""
    tp, _ = _tp()
    if x.shape[-1]:
        m = x.detach().amax(-1)
    else:  # a rank whose block is all padding
        m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)
    if tp > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    z = (x - m.unsqueeze(-1)).exp().sum(-1)
    if tp > 1:  # all-reduce forward (reduce_from) and backward (copy_to)
        z = reduce_from_tensor_model_parallel_region(copy_to_tensor_model_parallel_region(z))
    return m + z.log()


def _sum_blocks(x: torch.Tensor) -> torch.Tensor:
    return reduce_from_tensor_model_parallel_region(x) if _tp()[0] > 1 else x


def kd_per_token(student: torch.Tensor, teacher: torch.Tensor, temperature: float, vocab: int) -> torch.Tensor:
    """KL(teacher || student) per token ([b, s, V_local] logits -> [b, s]) at `temperature`
    (times its square), over the real vocabulary."""
    s, _ = real_block(student, vocab)
    t, _ = real_block(teacher.detach(), vocab)
    s, t = s / temperature, t / temperature
    log_ps = s - log_partition(s).unsqueeze(-1)
    log_pt = t - log_partition(t).unsqueeze(-1)
    return _sum_blocks((log_pt.exp() * (log_pt - log_ps)).sum(-1)) * temperature**2


def ce_per_token(logits: torch.Tensor, labels: torch.Tensor, vocab: int) -> torch.Tensor:
    """Next-token cross entropy per token ([b, s, V_local], [b, s] -> [b, s])."""
    x, start = real_block(logits, vocab)
    local = labels - start
    mine = (local >= 0) & (local < x.shape[-1])
    if x.shape[-1]:
        picked = x.gather(-1, local.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    else:  # an all-padding block holds no label
        picked = x.sum(-1)
    # log Z enters on the rank that holds the label only (see the module docstring).
    return _sum_blocks((log_partition(x) - picked) * mine)
