"""The device this process computes on: one CUDA device per rank, or the CPU."""

from __future__ import annotations

import time
from typing import Callable

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


def wall_clock(device: torch.device) -> Callable[[], float]:
    """`time.perf_counter`, read on a GPU once the device's queued kernels are done (they run
    asynchronously, so an unsynchronised reading times their launch only)."""
    if device.type != "cuda":
        return time.perf_counter

    def synchronized() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return synchronized
