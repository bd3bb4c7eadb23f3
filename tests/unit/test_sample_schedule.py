"""Megatron-LM's sample-based schedule against the iteration-based one with the corresponding
numbers: the same iterations and exactly the same learning rates, step by step."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.config.schema import OptimConfig, TrainConfig
from megatron_ext.training.batch_schedule import BatchSchedule
from megatron_ext.training.schedule import build_scheduler, scheduler_increment, train_iters

GBS = 16
# name -> (iteration-based optim fields, sample-based optim fields, iters, train_samples)
CASES = {
    "cosine": (
        dict(lr_warmup_iters=3, lr_decay_iters=15, lr_decay_style="cosine"),
        dict(lr_warmup_samples=3 * GBS, lr_decay_samples=15 * GBS, lr_decay_style="cosine"),
        20, 20 * GBS,
    ),
    # A trailing partial global batch is not trained (Megatron-LM's train_samples // gbs).
    "linear_partial_batch": (
        dict(lr_warmup_iters=4, lr_decay_style="linear"),
        dict(lr_warmup_samples=4 * GBS, lr_decay_samples=12 * GBS, lr_decay_style="linear"),
        12, 12 * GBS + GBS - 1,
    ),
    "inverse_square_root": (
        dict(lr_warmup_iters=2, lr_decay_style="inverse-square-root"),
        dict(lr_warmup_samples=2 * GBS, lr_decay_style="inverse-square-root"),
        10, 10 * GBS,
    ),
    # Unset warmup: 5% of the run in both units.
    "default_warmup": (
        dict(lr_decay_style="cosine"),
        dict(lr_decay_style="cosine"),
        40, 40 * GBS,
    ),
}


def _lrs(optim: OptimConfig, train: TrainConfig) -> list[float]:
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.0)
    batches = BatchSchedule(GBS)
    scheduler = build_scheduler(optimizer, optim, train, batches)
    lrs = []
    for _ in range(train_iters(train, batches)):
        scheduler.step(increment=scheduler_increment(train, batches, GBS))
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


@pytest.mark.parametrize("by_iters, by_samples, iters, samples", CASES.values(), ids=CASES.keys())
def test_sample_schedule_equals_iteration_schedule(by_iters, by_samples, iters, samples):
    lr = dict(lr=1e-3, min_lr=1e-5)
    reference = _lrs(OptimConfig(**lr, **by_iters), TrainConfig(iters=iters))
    sampled = _lrs(OptimConfig(**lr, **by_samples), TrainConfig(iters=999, train_samples=samples))
    assert len(sampled) == iters
    assert sampled == reference
    assert max(reference) == pytest.approx(1e-3, rel=0.2)  # the schedule does move
