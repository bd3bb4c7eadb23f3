"""The L2 norm of all model parameters, as Megatron-LM's `--log-params-norm` reports it.

Megatron-LM's `calc_params_l2_norm` lives in its training package, not in megatron-core; this is
the same sum for megatron-core 0.16's layouts: each parameter counted once, whatever the TP / PP
/ EP / DP layout. A tensor-parallel replica (a norm's weight on TP ranks > 0) and the last
stage's copy of tied embeddings are skipped; dense parameters are summed over the model-parallel
group (TP x PP), expert parameters over the expert model-parallel group (ETP x EP x PP). The
model's own parameters are read (every data-parallel rank holds them whole, the distributed
optimizer included), in fp32.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from megatron_ext.platform.device import current_device


def _sum_of_squares(params: list[torch.Tensor]) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float32, device=current_device())
    for p in params:
        total += p.detach().float().square().sum()
    return total


def params_l2_norm(model_chunks: list) -> float:
    """The norm of every parameter of the model; collective over the whole world."""
    dense, expert = [], []
    for chunk in model_chunks:
        for param in chunk.parameters():
            if not param_is_not_tensor_parallel_duplicate(param):
                continue
            if not getattr(param, "allreduce", True):  # megatron marks expert weights so
                expert.append(param)
            elif param_is_not_shared(param):
                dense.append(param)
    dense_sq, expert_sq = _sum_of_squares(dense), _sum_of_squares(expert)
    dist.all_reduce(dense_sq, group=parallel_state.get_model_parallel_group())
    dist.all_reduce(expert_sq, group=parallel_state.get_expert_tensor_model_pipeline_parallel_group())
    return math.sqrt(float(dense_sq + expert_sq))
