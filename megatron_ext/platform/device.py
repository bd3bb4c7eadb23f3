"""The device this process computes on: one CUDA device per rank, or the CPU."""

from __future__ import annotations

import torch


def resolve_device(requested: str, local_rank: int = 0) -> torch.device:
    """`launcher.device`: auto (CUDA when available) | cpu | cuda."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("launcher.device=cuda, but CUDA is not available on this machine")
    return torch.device("cuda", local_rank)


def current_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
