"""The low-rank half of a multi-adapter LoRA layer: S_i = x_i A_i^T ("shrink") and
Y_i = s_i * S_i B_i^T ("expand") over the row segments of K adapters.

Two interchangeable paths with one signature, picked by `select()`:
  - `reference`: a loop of plain matmuls per segment; runs anywhere, the oracle for the others.
  - `grouped`: one `torch._grouped_mm` per phase over all segments, ranks padded to the
    largest one with zeros (padding is transient: slots keep their own-rank tensors, so no
    padded entry exists to drift); chosen for bf16 on CUDA, where one launch should beat K
    small ones (not yet measured on a GPU: no GPU was available to this work).
  - `triton_segmm`: Triton kernels, one launch per phase (forward and backward) over all
    segments, no rank padding of the weights; "triton", chosen by name only: they are checked
    in Triton's interpreter but have never run on a GPU, so "auto" does not pick them until a
    GPU run has checked them. Imported only when selected, so CPU runs never import triton.
"""

from __future__ import annotations

import torch

from megatron_ext.lora.runtime.kernels import grouped, reference


NAMES = ("auto", "reference", "grouped", "triton")


def _triton():
    """The Triton kernel module, or None where triton does not import (it is an optional extra)."""
    try:
        from megatron_ext.lora.runtime.kernels import triton_segmm  # optional: triton (the triton extra)
    except ImportError:
        return None
    return triton_segmm


def select(device: torch.device, dtype: torch.dtype, name: str = "auto"):
    """The kernel module: "reference", "grouped", "triton" or "auto" (grouped for bf16 on CUDA
    where torch has the grouped GEMM, else reference)."""
    if name == "auto":
        fast = device.type == "cuda" and dtype == torch.bfloat16 and grouped.available()
        name = "grouped" if fast else "reference"
    if name not in NAMES:
        raise ValueError(f"lora.kernel: unknown kernel {name!r}; use one of {', '.join(NAMES)}")
    if name == "grouped" and not grouped.available():
        raise RuntimeError("lora kernels: torch._grouped_mm is not available in this torch build")
    if name == "triton":
        module = _triton()
        if module is None:
            raise RuntimeError("lora kernels: triton does not import (pip install megatron_ext[triton])")
        if device.type != "cuda" and not module.interpreted():
            raise RuntimeError("lora kernels: triton runs on CUDA tensors only (or under TRITON_INTERPRET=1, set before import)")
        return module
    return {"reference": reference, "grouped": grouped}[name]
