"""fp16 with megatron's dynamic loss scaler: steps skipped on overflow are counted and logged,
training goes on, and only the run of skips past the scaler's floor stops it (skipped_steps.py).

Megatron-LM's scaler starts at 2^32, where the first steps of any model overflow in fp16; it
halves the scale after `hysteresis` (2) consecutive overflows until a step succeeds.
"""

from __future__ import annotations

import math

import pytest
from megatron.core.optimizer import OptimizerConfig

from megatron_ext.train import run_from_overrides

COMMON = [
    "experiment=none",
    "model.precision=fp16",
    "train.eval_interval=0",
    "logging.progress_bar=false",
    "model.seq_length=64",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "launcher.nproc=1",
]


def train(tmp_path, *overrides: str) -> dict:
    return run_from_overrides([*COMMON, f"data.cache_dir={tmp_path}", *overrides])


def skipped_iterations(summary: dict) -> list[int]:
    return [int(n.split()[1]) for n in summary["notes"] if " skipped: " in n]


def test_fp16_trains_on_after_the_loss_scaler_skips_its_first_steps(tmp_path):
    iters = 36
    summary = train(tmp_path, f"train.iters={iters}")
    skipped = skipped_iterations(summary)
    losses = summary["losses"]
    assert len(losses) == iters
    assert skipped[:2] == [1, 2]  # at 2^32 even a tiny model's gradients overflow fp16
    updated = [i for i in range(1, iters + 1) if i not in skipped]
    assert len(updated) >= 8, skipped
    first_update = updated[0]
    # The weights did not move during the skips, so the loss only falls after the first update.
    assert losses[-1] < losses[first_update - 1] - 0.5, losses


def test_fp16_stops_once_steps_overflow_at_the_minimum_loss_scale(tmp_path):
    """Weights so large that the forward overflows fp16: every step is skipped. The scale
    halves from the second skip on until it reaches the floor; `hysteresis` further overflows
    there stop the run."""
    defaults = OptimizerConfig()
    halvings = int(math.log2(defaults.initial_loss_scale / defaults.min_loss_scale))
    expected_stop = (defaults.hysteresis - 1) + halvings + defaults.hysteresis
    with pytest.raises(FloatingPointError, match=f"iteration {expected_stop} skipped.*minimum loss scale 1"):
        train(tmp_path, "train.iters=60", "model.init_method_std=1000")
