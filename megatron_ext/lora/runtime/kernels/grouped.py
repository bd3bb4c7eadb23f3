"""One grouped GEMM per phase for all adapter segments (platform/grouped_mm.py).

Ranks differ per adapter: A and B are zero-padded to the largest rank inside the call, so the
padded rank columns of S are exactly zero and contribute nothing to Y; autograd routes gradients
back to the unpadded slices only."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from megatron_ext.platform.grouped_mm import available, grouped_mm

__all__ = ["available", "expand", "shrink"]


def _padded_rank(ranks) -> int:
    # CUDA's grouped GEMM wants 16-byte aligned strides: a multiple of 8 bf16 elements.
    return -(-max(ranks) // 8) * 8


def _offsets(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, device=device).cumsum(0).to(torch.int32)


def shrink(xs: Sequence[torch.Tensor], a: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    r_max = _padded_rank(w.shape[0] for w in a)
    stacked = torch.stack([F.pad(w, (0, 0, 0, r_max - w.shape[0])).t() for w in a])  # [K, in, r_max]
    rows = [x.shape[0] for x in xs]
    out = grouped_mm(torch.cat(list(xs)).contiguous(), stacked, _offsets(rows, stacked.device))
    return [s[:, : w.shape[0]] for s, w in zip(out.split(rows), a)]


def expand(ss: Sequence[torch.Tensor], b: Sequence[torch.Tensor], scales: Sequence[float]) -> list[torch.Tensor]:
    r_max = _padded_rank(w.shape[1] for w in b)
    stacked = torch.stack([(F.pad(w, (0, r_max - w.shape[1])) * scale).t() for w, scale in zip(b, scales)])
    padded = torch.cat([F.pad(s, (0, r_max - s.shape[1])) for s in ss]).contiguous()
    rows = [s.shape[0] for s in ss]
    out = grouped_mm(padded, stacked, _offsets(rows, stacked.device))
    return list(out.split(rows))
