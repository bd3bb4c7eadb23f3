"""Every tensor of a torch_dist checkpoint, read whole (all shards) without a process group."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron_ext.checkpointing.torch_dist import iteration_dir


def checkpoint_tensors(root: Path, iteration: int, scratch: Path) -> dict[str, torch.Tensor]:
    """The tensors of checkpoint `iteration` under `root`, by key (`scratch`: a file to write)."""
    dcp_to_torch_save(iteration_dir(root, iteration), scratch)
    return {k: v for k, v in torch.load(scratch, weights_only=False).items() if isinstance(v, torch.Tensor)}
