"""The low-rank half of a multi-adapter LoRA layer: S_i = x_i A_i^T ("shrink") and
Y_i = s_i * S_i B_i^T ("expand") over the row segments of K adapters.

Two interchangeable paths with one signature, picked by `select()`:
  - `reference`: a loop of plain matmuls per segment; runs anywhere, the oracle for the others.
  - `grouped`: one `torch._grouped_mm` per phase over all segments, ranks padded to the
    largest one with zeros (padding is transient: slots keep their own-rank tensors, so no
    padded entry exists to drift); used on CUDA, where one launch beats K small ones.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from megatron_ext.lora.kernels import grouped, reference

Shrink = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], list[torch.Tensor]]
Expand = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[float]], list[torch.Tensor]]


def select(device: torch.device, name: str = "auto"):
    """The kernel module for `device`: "reference", "grouped" or "auto"."""
    if name == "auto":
        name = "grouped" if device.type == "cuda" and grouped.available() else "reference"
    if name == "grouped" and not grouped.available():
        raise RuntimeError("lora kernels: torch._grouped_mm is not available in this torch build")
    return {"reference": reference, "grouped": grouped}[name]
