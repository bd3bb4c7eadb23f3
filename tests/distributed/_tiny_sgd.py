"""The tiny model and SGD run the layout-equality tests train (one rank against TP / PP layouts):
SGD at a large learning rate, so a wrong gradient shows in the weights after a few steps."""

from __future__ import annotations

import dataclasses

STEPS = 3
LR = 0.5


def config(name: str, changes: dict, parallel: dict, cache: str):
    from megatron_ext.config.schema import (
        Config,
        DataConfig,
        LoggingConfig,
        ModelConfig,
        OptimConfig,
        ParallelConfig,
        TrainConfig,
    )

    base = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, seq_length=32)
    return Config(
        model=dataclasses.replace(base, name=name, **changes),
        # megatron's distributed optimizer takes Adam only.
        parallel=ParallelConfig(**parallel, use_distributed_optimizer=False),
        data=DataConfig(cache_dir=cache),
        optim=OptimConfig(optimizer="sgd", lr=LR, min_lr=LR, lr_warmup_iters=0),
        train=TrainConfig(iters=STEPS, micro_batch_size=2, global_batch_size=4, eval_interval=0),
        logging=LoggingConfig(progress_bar=False),
    )
