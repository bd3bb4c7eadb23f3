"""Non-finite and diverging training, caught before it is applied or written.

Megatron-LM's `--check-for-nan-in-loss-and-grad` (on by default) stops a step with a NaN loss or
gradient. Here the check is the global gradient norm, taken before the optimizer updates anything:
megatron's optimizer computes it over every rank (the same value everywhere), and any NaN or
infinite gradient on any rank makes it non-finite, so all ranks agree without a collective of
their own. A fault names the ranks it arose on: those whose own gradients were not finite
before the data-parallel reduction spread them to their replicas (Megatron-LM checks the local
gradients there too), or whose own loss was not. A loss above `train.spike_factor` times the mean
of the last `train.spike_window` steps' losses is a fault too (Megatron-LM's
`--check-for-spiky-loss`). `train.nan_policy` says what follows a fault: `stop` (nothing more is
saved; the newest checkpoint stays the last good one) or `rollback` (training/trainer.py reloads
the newest checkpoint, skips the batches since it and lowers the lr). With fp16 the loss scaler skips non-finite steps itself, as in Megatron-LM.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


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
    """The global gradient norm the optimizer's step would clip with, computed before the step.
    Without a loss scaler `prepare_grads` only copies gradients into place, so `step()` doing it
    again changes nothing (with one it unscales: fp16 is checked by its scaler instead)."""
    optimizer.prepare_grads()
    return float(optimizer.get_grad_norm())


def grads_finite(model: list) -> bool:
    """Whether every gradient this rank holds (its main grads) is finite."""
    return all(
        torch.isfinite(p.main_grad).all()
        for chunk in model
        for p in chunk.parameters()
        if getattr(p, "main_grad", None) is not None
    )


def losses_finite(losses: list[dict]) -> bool:
    """Whether this rank's own micro-batch losses are finite (only the last pipeline stage has
    any)."""
    return all(torch.isfinite(entry["lm loss"]).all() for entry in losses)


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
