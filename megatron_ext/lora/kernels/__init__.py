"""The low-rank half of a multi-adapter LoRA layer: S_i = x_i A_i^T ("shrink") and
Y_i = s_i * S_i B_i^T ("expand") over the row segments of K adapters.

Two interchangeable paths with one signature, picked by `select()`:
  - `reference`: a loop of plain matmuls per segment; runs anywhere, the oracle for the others.
  - `grouped`: one `torch._grouped_mm` per phase over all segments, ranks padded to the
    largest one with zeros (padding is transient: slots keep their own-rank tensors, so no
    padded entry exists to drift); chosen for bf16 on CUDA, where one launch should beat K
    small ones (not yet measured on a GPU: no GPU was available to this work).
"""

from __future__ import annotations

import torch

from megatron_ext.lora.kernels import grouped, reference


def select(device: torch.device, dtype: torch.dtype, name: str = "auto"):
    """The kernel module: "reference", "grouped" or "auto" (grouped for bf16 on CUDA, the only
    case where torch's grouped GEMM is both supported and worth it)."""
    if name == "auto":
        fast = device.type == "cuda" and dtype == torch.bfloat16 and grouped.available()
        name = "grouped" if fast else "reference"
    if name not in ("reference", "grouped"):
        raise ValueError(f"lora.kernel: unknown kernel {name!r}; use auto, reference or grouped")
    if name == "grouped" and not grouped.available():
        raise RuntimeError("lora kernels: torch._grouped_mm is not available in this torch build")
    return {"reference": reference, "grouped": grouped}[name]
