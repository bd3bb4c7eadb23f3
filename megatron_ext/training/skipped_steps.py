"""Steps the fp16 loss scaler skips: counted and logged as Megatron-LM does, and the one run of
them that stops training.

A skipped step has no gradient norm and no count of zeros in the gradients: megatron's optimizer
returns None for both, and Megatron-LM's training_log then leaves them out of its log line,
TensorBoard and W&B (`gradient_stats`).

Megatron-LM (`train_step` in megatron/training/training.py) calls a step whose optimizer update
was unsuccessful a skipped iteration: the iteration and the consumed samples advance, the
learning-rate schedule does not, and its log counts "number of skipped iterations". With dynamic
loss scaling it switches its NaN checks off (`check_for_nan_in_loss_and_grad`, arguments.py),
because overflowing gradients are the scaler's signal; so no count of skipped iterations stops a
Megatron-LM run. What bounds them is megatron's `DynamicGradScaler`: after `hysteresis`
consecutive overflows it halves the scale with every further one, down to `min_loss_scale` and
no lower (from 2^32 to 1 with Megatron-LM's defaults: 33 consecutive skips).

The limit followed here is that floor: a run stops when `hysteresis` consecutive steps overflow
with the scale already at `min_loss_scale` (Megatron-LM's default 1: the gradients overflow
unscaled), where the scaler has nothing left to back off and Megatron-LM would go on skipping.
Every shorter run of skips, e.g. the 24 with which the tiny test model's fp16 training starts, is
logged and counted and training goes on.
"""

from __future__ import annotations

from typing import Optional


def gradient_stats(grad_norm: Optional[float], num_zeros_in_grad: Optional[float]) -> dict[str, float]:
    """The step's metrics grad_norm and num_zeros_in_grad, each only where megatron's optimizer
    measured it (not on a skipped step; no grad norm without clipping on the fp32 optimizer):
    a made-up value would be logged as if measured."""
    stats = {"grad_norm": grad_norm, "num_zeros_in_grad": num_zeros_in_grad}
    return {key: float(value) for key, value in stats.items() if value is not None}


class SkippedSteps:
    """The skipped steps of one run (across optimizers rebuilt by a change of layout)."""

    def __init__(self) -> None:
        self.total = 0
        self._overflows_at_floor = 0  # consecutive, since the last successful step

    def record(self, iteration: int, updated: bool, scale_used: float, optimizer) -> Optional[str]:
        """Account for step `iteration` of megatron's `optimizer`, run with loss scale
        `scale_used`. Returns the log line of a skipped step (None for a successful one); raises
        FloatingPointError once the skips pass the limit above."""
        if updated:
            self._overflows_at_floor = 0
            return None
        self.total += 1
        floor, hysteresis = optimizer.config.min_loss_scale, optimizer.config.hysteresis
        if scale_used <= floor:
            self._overflows_at_floor += 1
        line = (
            f"iteration {iteration} skipped: gradients overflowed at loss scale {scale_used:g}, "
            f"next {optimizer.get_loss_scale().item():g} ({self.total} skipped so far)"
        )
        if self._overflows_at_floor >= hysteresis:
            raise FloatingPointError(
                f"{line}; {self._overflows_at_floor} consecutive steps overflowed at the minimum "
                f"loss scale {floor:g}: the gradients overflow even unscaled"
            )
        return line
