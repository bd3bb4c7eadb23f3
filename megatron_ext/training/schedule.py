"""How long a run trains and how its learning rate moves: by iterations or, as Megatron-LM's
`--train-samples` / `--lr-warmup-samples` / `--lr-decay-samples`, by samples.

Megatron-LM's `get_optimizer_param_scheduler` feeds megatron-core's `OptimizerParamScheduler`
sample counts: the run trains `train_samples // global_batch_size` iterations, warmup and decay
are given in samples, and the scheduler advances by one global batch per iteration. An
iteration-based run counts iterations and advances by one: with a fixed global batch both give
the same learning rates, and the iteration count does not change when a layout change changes
a derived global batch (train.global_batch_size null).
"""

from __future__ import annotations

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_ext.config.schema import OptimConfig, TrainConfig


def train_iters(train: TrainConfig, global_batch_size: int) -> int:
    """The iterations the run trains. Samples: the whole global batches they fill (Megatron-LM's
    `update_train_iters`; a trailing partial batch is not trained)."""
    if train.train_samples is None:
        return train.iters
    return train.train_samples // global_batch_size


def warmup_iters(optim: OptimConfig, iters: int) -> int:
    """Iteration-based warmup; unset: 5% of the run."""
    return optim.lr_warmup_iters if optim.lr_warmup_iters is not None else iters // 20


def scheduler_increment(train: TrainConfig, global_batch_size: int) -> int:
    """What one iteration advances the scheduler by: a global batch of samples, or one step."""
    return global_batch_size if train.train_samples is not None else 1


def build_scheduler(
    optimizer, optim: OptimConfig, train: TrainConfig, global_batch_size: int
) -> OptimizerParamScheduler:
    """megatron-core's scheduler for `optimizer`, in samples when `train.train_samples` is set
    (unset sample warmup: the iteration default in samples), else in iterations."""
    iters = train_iters(train, global_batch_size)
    if train.train_samples is None:
        warmup, decay, wd_steps = warmup_iters(optim, iters), optim.lr_decay_iters or iters, iters
    else:
        warmup = optim.lr_warmup_samples
        if warmup is None:
            warmup = warmup_iters(optim, iters) * global_batch_size
        decay, wd_steps = optim.lr_decay_samples or train.train_samples, train.train_samples
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
