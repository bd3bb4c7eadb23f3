"""Megatron's DistributedDataParallel around one rank's model chunks, set up as a layout asks.

The Trainer wraps its model with it, and the reshard planner wraps a meta-device copy the same way
to learn where each rank's gradient and optimizer buffers lie: both must agree.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig

from megatron_ext.config.schema import ParallelConfig


def ddp_config(parallel: ParallelConfig) -> DistributedDataParallelConfig:
    """Megatron DDP settings of a layout."""
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=parallel.overlap_grad_reduce,
        use_distributed_optimizer=parallel.use_distributed_optimizer,
    )


def wrap_in_ddp(
    config: TransformerConfig,
    parallel: ParallelConfig,
    chunks: list,
    groups: Optional[ProcessGroupCollection] = None,
) -> list[DistributedDataParallel]:
    """Each model chunk (one per virtual pipeline stage) in megatron's DDP; `groups` None: the
    groups of megatron's parallel state."""
    return [
        # Megatron-LM's rule: only the first chunk buckets its grads (overlap happens there).
        DistributedDataParallel(config, ddp_config(parallel), chunk, disable_bucketing=i > 0, pg_collection=groups)
        for i, chunk in enumerate(chunks)
    ]
