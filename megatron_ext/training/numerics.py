"""Non-finite and diverging training, caught before it is applied or written.

Megatron-LM's `--check-for-nan-in-loss-and-grad` (on by default) stops a step with a NaN loss or
gradient. Here the check is the global gradient norm, taken before the optimizer updates anything:
megatron's optimizer computes it over every rank (the same value everywhere), and any NaN or
infinite gradient on any rank makes it non-finite, so all ranks agree without a collective of
their own. It is the norm megatron's step computes anyway (platform/grad_norm_check.py), not a
second one. A fault names the ranks it arose on: those
whose own gradients were not finite before the data-parallel reduction spread them to their
replicas (Megatron-LM checks the local gradients there too; noted on the device, read only after
a fault), or whose own loss was not. The losses are read every step while the check is on, as
Megatron-LM's check reads them. A loss above `train.spike_factor` times the mean of the last
`train.spike_window` steps' losses is a fault too (Megatron-LM's `--check-for-spiky-loss`).
`train.nan_policy` says what follows a fault: `stop` (nothing more is saved; the newest
checkpoint stays the last good one) or `rollback` (training/trainer.py reloads the newest
checkpoint, skips the batches since it and lowers the lr). With fp16 the loss scaler skips
non-finite steps itself, as in Megatron-LM.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_ext.platform.grad_norm_check import NonFiniteGradNorm


@dataclass
class Fault(Exception):
    """A step that must not stand: `what` happened at `iteration` (on `ranks`, where known)."""

    iteration: int
    what: str
    consumed_samples: int  # the data position after the step's batch
    ranks: tuple[int, ...] = ()

    def __str__(self) -> str:
        where = f" on rank {', '.join(map(str, self.ranks))}" if self.ranks else ""
        return f"iteration {self.iteration}: {self.what}{where}"


def gradient_norm_before_step(optimizer) -> float:
    """The global gradient norm, computed before the step, for an optimizer whose step computes
    none (no clipping; otherwise the check rides on the step's own norm, platform/grad_norm_check.py).
    Without a loss scaler `prepare_grads` only copies gradients into place, so `step()` doing it
    again changes nothing (with one it unscales: fp16 is checked by its scaler instead)."""
    optimizer.prepare_grads()
    return float(optimizer.get_grad_norm())


def check_grad_norm(norm: float) -> None:
    """Raise NonFiniteGradNorm for a NaN or infinite norm, as the check inside the step does."""
    if not math.isfinite(norm):
        raise NonFiniteGradNorm(norm)


def grads_finite(model: list) -> torch.Tensor:
    """Whether every gradient this rank holds (its main grads) is finite: a device bool, read
    only after a fault (no host sync per step). Megatron's DDP keeps the main grads in a few
    contiguous buffers, each checked by its sum: a NaN or an infinity makes the sum non-finite,
    and a sum that overflows needs gradients whose squares overflow the norm as well. (A sum
    reads the buffer once; `isfinite(...).all()` writes a bool per element and is 25x slower on
    CPU.)"""
    flags = [torch.isfinite(grads.sum()) for chunk in model for grads in _main_grad_storage(chunk)]
    return torch.stack(flags).all() if flags else torch.tensor(True)


def _main_grad_storage(chunk) -> list[torch.Tensor]:
    """The tensors holding `chunk`'s main grads: its DDP's grad buffers, or each parameter's."""
    if hasattr(chunk, "buffers") and hasattr(chunk, "expert_parallel_buffers"):
        return [buffer.grad_data for buffer in chunk.buffers + chunk.expert_parallel_buffers]
    return [p.main_grad for p in chunk.parameters() if getattr(p, "main_grad", None) is not None]


def ranks_where(flag: bool) -> tuple[int, ...]:
    """The ranks whose `flag` is true (collective: only after a fault, which every rank meets)."""
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(flag))
    return tuple(rank for rank, flagged in enumerate(flags) if flagged)


class LossSpikes:
    """A loss above `factor` times the mean of the last `window` losses; NaN is always one."""

    def __init__(self, factor: Optional[float], window: int) -> None:
        self.factor = factor
        self.recent: deque[float] = deque(maxlen=window)

    def check(self, iteration: int, loss: float, consumed_samples: int) -> None:
        if not math.isfinite(loss):
            raise Fault(iteration, f"loss {loss}", consumed_samples)
        if self.factor is not None and len(self.recent) == self.recent.maxlen:
            mean = sum(self.recent) / len(self.recent)
            if loss > self.factor * mean:
                raise Fault(
                    iteration, f"loss {loss:.4g} above {self.factor:g} x the mean {mean:.4g} of the last {len(self.recent)} steps",
                    consumed_samples,
                )
        self.recent.append(loss)

    def clear(self) -> None:
        self.recent.clear()
