"""A layout's process groups, as megatron's `parallel_state` makes them.

Megatron keeps the groups of the running layout in the globals of `megatron.core.parallel_state`;
`initialize_model_parallel` creates them (collective over the world) and `destroy_model_parallel`
forgets them.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from megatron_ext.config.schema import ParallelConfig
from megatron_ext.parallel.release import release_in_background
from megatron_ext.platform.torch_worlds import live_groups


def parallel_state_sizes(parallel: ParallelConfig) -> dict[str, Any]:
    """megatron's `initialize_model_parallel` arguments for a layout."""
    return dict(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
    )


def destroy_groups(groups: list, in_background: bool = False) -> None:
    """Destroy the process groups megatron created (`_global_process_group_list`). Megatron
    only forgets most of its groups, and each keeps its threads and sockets: a job that changes
    layout many times would pile them up. `in_background`: torch forgets them here, and a
    background thread drops the objects (their destructors take tens of ms each, release.py)."""
    live = set(live_groups())
    for group in groups:
        if group is not None and group in live:  # megatron destroys its gloo ones
            dist.destroy_process_group(group)
    if in_background:
        release_in_background(groups)
