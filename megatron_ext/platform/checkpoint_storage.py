"""The files a checkpoint's tensors are stored in, read from its metadata.

megatron's `torch_dist` checkpoints are torch.distributed.checkpoint folders: `.metadata` maps
every stored item to its place, a file with an offset and a length (torch's private
`_StorageInfo`). A shard cut short or lost is then found before any rank reads it. The layout of
that record is torch's own: it is read only for the torch versions it was checked against.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from megatron_ext.platform.versions import CHECKED

# The torch versions whose `.metadata` records were checked to hold `relative_path`, `offset`
# and `length` per item.
CHECKED_TORCH = CHECKED["checkpoint_storage"]


class UncheckedTorch(RuntimeError):
    """This torch's checkpoint metadata was not checked: its storage records are not read."""


def checkpoint_files(folder: str | os.PathLike, torch_version: Optional[str] = None) -> dict[str, int]:
    """Every file the checkpoint in `folder` stores items in (relative to `folder`) -> the bytes
    it must hold at least: the end of its last item. Raises UncheckedTorch outside
    CHECKED_TORCH, and what unpickling raises for a missing or damaged `.metadata`."""
    _check_version(torch_version or torch.__version__)
    # heavy: torch.distributed.checkpoint (~1.8 s), off preflight unless a checkpoint is read
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(folder)).read_metadata().storage_data or {}
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    return needed


def _check_version(version: str) -> None:
    if not CHECKED_TORCH.covers(version):
        raise UncheckedTorch(
            f"torch {version} is outside the versions whose checkpoint metadata is read here "
            f"({CHECKED_TORCH.describe()})"
        )
