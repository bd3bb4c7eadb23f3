"""A check of the global gradient norm inside megatron's optimizer step, before its update.

megatron's `step()` computes the global gradient norm once (it clips with it), after preparing
the gradients and before `step_with_ready_grads()` updates anything. The NaN check
(training/numerics.py) needs exactly that number at exactly that point; computing it again
beforehand costs a second pass over every gradient and a second all-reduce per step. So the check
wraps, on the optimizer instance, the method megatron's `step()` takes the norm from: the single
optimizers' `clip_grad_norm` (which also clips: with a NaN norm megatron's clip is a no-op and an
infinite one zeroes finite gradients, neither of which reaches the weights, since the update is
never run) and `ChainedOptimizer.get_grad_norm`. Which method `step()` calls is megatron-core's
internal structure (checked with the megatron-core of `versions.CHECKED["grad_norm_check"]`).
Without clipping megatron's single optimizers compute no norm: `takes_norm_in_step` says so, and
the caller then computes it before the step.
"""

from __future__ import annotations

import math
from typing import Callable

from megatron.core.optimizer import ChainedOptimizer


class NonFiniteGradNorm(Exception):
    """megatron's optimizer step found a NaN or infinite global gradient norm; nothing was updated."""

    def __init__(self, norm: float) -> None:
        super().__init__(f"gradient norm {norm}")
        self.norm = norm


def takes_norm_in_step(optimizer) -> bool:
    """Whether `optimizer.step()` computes the global gradient norm (so the check can ride on it)."""
    return isinstance(optimizer, ChainedOptimizer) or optimizer.config.clip_grad > 0.0


def refuse_nonfinite_grad_norm(optimizer) -> None:
    """Make `optimizer.step()` raise NonFiniteGradNorm before its update when the norm it computes
    is not finite. Only where `takes_norm_in_step(optimizer)`."""
    name = "get_grad_norm" if isinstance(optimizer, ChainedOptimizer) else "clip_grad_norm"
    setattr(optimizer, name, _checked(getattr(optimizer, name)))


def _checked(compute_norm: Callable[..., float]) -> Callable[..., float]:
    def checked(*args, **kwargs) -> float:
        norm = compute_norm(*args, **kwargs)
        if not math.isfinite(norm):
            raise NonFiniteGradNorm(norm)
        return norm

    return checked
