"""How long a run trains and how its learning rate moves: by iterations or, as Megatron-LM's
`--train-samples` / `--lr-warmup-samples` / `--lr-decay-samples`, by samples.

Megatron-LM's `get_optimizer_param_scheduler` feeds megatron-core's `OptimizerParamScheduler`
sample counts: the run trains the iterations its `train_samples` fill, warmup and decay are
given in samples, and the scheduler advances by each step's global batch. An iteration-based run
with a fixed global batch counts iterations and advances by one: the same learning rates, and
the iteration count does not change when a layout change changes a derived global batch
(train.global_batch_size null). An iteration-based run whose global batch varies (a ramp or a
step schedule, batch_schedule.py) counts samples as Megatron-LM does: its iteration counts
times the global batch (Megatron-LM's args.global_batch_size), advanced by each step's batch.
"""

from __future__ import annotations

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_ext.config.schema import OptimConfig, TrainConfig
from megatron_ext.training.batch_schedule import BatchSchedule


def train_iters(train: TrainConfig, batches: BatchSchedule) -> int:
    """The iterations the run trains. Samples: as Megatron-LM's `update_train_iters` counts
    them (BatchSchedule.train_iters)."""
    if train.train_samples is None:
        return train.iters
    return batches.train_iters(train.train_samples)


def warmup_iters(optim: OptimConfig, iters: int) -> int:
    """Iteration-based warmup; unset: 5% of the run."""
    return optim.lr_warmup_iters if optim.lr_warmup_iters is not None else iters // 20


def counts_samples(train: TrainConfig, batches: BatchSchedule) -> bool:
    """Whether the scheduler counts samples (else iterations)."""
    return train.train_samples is not None or batches.varies


def scheduler_increment(train: TrainConfig, batches: BatchSchedule, global_batch: int) -> int:
    """What a step of `global_batch` samples advances the scheduler by: the samples, or one step."""
    return global_batch if counts_samples(train, batches) else 1


def build_scheduler(
    optimizer, optim: OptimConfig, train: TrainConfig, batches: BatchSchedule
) -> OptimizerParamScheduler:
    """megatron-core's scheduler for `optimizer`, in samples when `train.train_samples` is set
    (unset sample warmup: the iteration default in samples) or the batch varies (iteration
    counts in samples of the global batch), else in iterations."""
    iters, gbs = train_iters(train, batches), batches.global_batch_size
    if train.train_samples is not None:
        warmup = optim.lr_warmup_samples
        if warmup is None:
            warmup = warmup_iters(optim, iters) * gbs
        decay, wd_steps = optim.lr_decay_samples or train.train_samples, train.train_samples
    else:
        per_iteration = gbs if batches.varies else 1
        warmup = warmup_iters(optim, iters) * per_iteration
        decay = (optim.lr_decay_iters or iters) * per_iteration
        wd_steps = iters * per_iteration
    return OptimizerParamScheduler(
        optimizer,
        init_lr=optim.lr_warmup_init,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=wd_steps,
        wd_incr_style="constant",
    )


def scale_lr(scheduler: OptimizerParamScheduler, factor: float) -> None:
    """Multiply the schedule's peak and final lr by `factor` (and those of the parameter groups
    that have their own, the decoupled lr's), from the current step on."""
    scheduler.max_lr *= factor
    scheduler.min_lr *= factor
    for group in scheduler.optimizer.param_groups:
        for key in ("max_lr", "min_lr"):
            if key in group:
                group[key] *= factor
    scheduler.step(increment=0)  # the groups' lr of this step, recomputed
