"""torch's grouped GEMM: one kernel for many matrix products of different row counts.

`torch._grouped_mm` is private (checked with the torch of `versions.CHECKED["grouped_mm"]`):
`a` [sum of rows, k] times `b` [groups, k, n], group g taking the rows up to `offsets[g]`.
"""

from __future__ import annotations

import torch


def available() -> bool:
    """Whether this torch build has the grouped GEMM."""
    return hasattr(torch, "_grouped_mm")


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[sum of rows, n]: each group's rows of `a` times its matrix of `b`; `offsets` (int32)
    are the groups' cumulative row counts."""
    return torch._grouped_mm(a, b, offs=offsets)
