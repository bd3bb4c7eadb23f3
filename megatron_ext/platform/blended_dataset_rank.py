"""A weighted blend of datasets built in a plain single process (no torch.distributed).

megatron-core 0.16's `BlendedDataset._build_indices` calls `torch.distributed.get_rank()` on a
cache miss without checking `is_initialized()` (GPTDataset does check), so a weighted blend
crashes in a single process. There the only rank is 0: `single_process_is_rank_zero()` says so
for the block (checked with the megatron-core of `versions.CHECKED["blended_dataset_rank"]`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator
from unittest import mock

import torch.distributed as dist


@contextlib.contextmanager
def single_process_is_rank_zero() -> Iterator[None]:
    """Within the block, `torch.distributed.get_rank()` answers 0 when no process group exists."""
    if dist.is_initialized():
        yield
        return
    with mock.patch.object(dist, "get_rank", lambda group=None: 0):
        yield
