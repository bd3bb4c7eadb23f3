"""The torch reference path: one matmul per adapter segment (any device, any dtype)."""

from __future__ import annotations

from typing import Sequence

import torch


def shrink(xs: Sequence[torch.Tensor], a: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per segment i: xs[i] [rows_i, in] @ a[i]^T ([r_i, in]) -> [rows_i, r_i]."""
    return [x @ w.t() for x, w in zip(xs, a)]


def expand(ss: Sequence[torch.Tensor], b: Sequence[torch.Tensor], scales: Sequence[float]) -> list[torch.Tensor]:
    """Per segment i: scales[i] * ss[i] [rows_i, r_i] @ b[i]^T ([out, r_i]) -> [rows_i, out]."""
    return [(s @ w.t()) * scale for s, w, scale in zip(ss, b, scales)]
