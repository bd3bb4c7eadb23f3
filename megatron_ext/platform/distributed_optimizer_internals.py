"""What megatron's DistributedOptimizer knows only through its private methods.

megatron-core has no public way to ask which part of each parameter a data-parallel rank
updates, or to read one parameter's fp32 main copy and Adam state: the answers are its private
`_build_model_gbuf_range` and `_get_main_param_and_optimizer_states` (checked with the
megatron-core of `versions.CHECKED["distributed_optimizer_internals"]`).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megatron_ext.platform.fake_build import fake_group


def dp_param_ranges(buffer, dp_index: int) -> dict[torch.Tensor, tuple[int, int]]:
    """Megatron's own answer to "which part of each parameter does DP index d update", asked of
    DDP's param-and-grad `buffer` as DP rank d would see it."""
    as_seen_by = SimpleNamespace(
        data_parallel_group=fake_group(dp_index, buffer.data_parallel_world_size),
        buckets=buffer.buckets,
        param_index_map=buffer.param_index_map,
    )
    ranges = {}
    for bucket in range(len(buffer.buckets)):
        param_map = DistributedOptimizer._build_model_gbuf_range(as_seen_by, bucket)["param_map"]
        ranges.update({p: (r["param"].start, r["param"].end) for p, r in param_map.items()})
    return ranges


def main_param_and_states(optimizer: DistributedOptimizer, param: torch.Tensor) -> dict[str, torch.Tensor]:
    """`param`'s fp32 main copy ("param") and optimizer state ("exp_avg", ...) in `optimizer`,
    which must update it."""
    return optimizer._get_main_param_and_optimizer_states(param)
