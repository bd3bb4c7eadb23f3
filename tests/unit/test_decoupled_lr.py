"""Megatron-LM's --lr-warmup-init and --decoupled-lr / --decoupled-min-lr: every parameter group
of the trainer's megatron optimizer follows the warmup-then-decay formula, written out here,
from optim.lr_warmup_init; the groups holding the embedding and the output layer peak at
decoupled_lr and end at decoupled_min_lr (min_lr when unset), the others at lr / min_lr."""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist

from megatron_ext.config import compose_config
from megatron_ext.platform.launch import join_world
from megatron_ext.training.trainer import Trainer

ITERS, WARMUP, LR, MIN_LR = 12, 4, 1e-3, 1e-4
COMMON = [
    "experiment=none",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.seq_length=32",
    "model.tie_embeddings=false",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    f"train.iters={ITERS}",
    f"optim.lr={LR}",
    f"optim.min_lr={MIN_LR}",
    f"optim.lr_warmup_iters={WARMUP}",
    "parallel.use_distributed_optimizer=false",  # the groups then hold the model's own params
    "launcher.nproc=1",
]
# name -> (overrides, embedding/output peak lr, its final lr)
CASES = {
    "warmup_init": (["optim.lr_warmup_init=2e-4"], LR, MIN_LR),
    "decoupled": (["optim.decoupled_lr=5e-3", "optim.decoupled_min_lr=5e-4"], 5e-3, 5e-4),
    "decoupled_linear_from_init": (
        ["optim.decoupled_lr=3e-4", "optim.lr_warmup_init=1e-4", "optim.lr_decay_style=linear"], 3e-4, MIN_LR,
    ),
}


def expected_lr(step: int, init: float, peak: float, final: float, style: str) -> float:
    if step <= WARMUP:
        return init + (peak - init) * step / WARMUP
    progress = (step - WARMUP) / (ITERS - WARMUP)
    coeff = 1.0 - progress if style == "linear" else 0.5 * (math.cos(math.pi * progress) + 1.0)
    return final + coeff * (peak - final)


def group_lrs(overrides: list[str], tmp_path) -> tuple[list[list[float]], list[bool], dict]:
    """Each step's lr of every param group, whether a group holds the embedding or output
    layer, and the optim config."""
    join_world("cpu")
    cfg = compose_config([*COMMON, f"data.cache_dir={tmp_path}", *overrides])
    trainer = Trainer(cfg)
    try:
        trainer.setup()
        model = trainer.model[0].module
        edge = {id(model.embedding.word_embeddings.weight), id(model.output_layer.weight)}
        groups = trainer.optimizer.param_groups
        holds_edge = [any(id(p) in edge for p in g["params"]) for g in groups]
        lrs = []
        for _ in range(ITERS + 2):  # past the decay end: the final lr
            trainer.scheduler.step(increment=1)
            lrs.append([g["lr"] for g in groups])
        return lrs, holds_edge, cfg.optim
    finally:
        trainer.close()
        dist.destroy_process_group()


@pytest.mark.parametrize("overrides, edge_peak, edge_final", CASES.values(), ids=CASES.keys())
def test_each_param_group_follows_its_schedule(overrides, edge_peak, edge_final, tmp_path):
    lrs, holds_edge, optim = group_lrs(overrides, tmp_path)
    assert any(holds_edge) and not all(holds_edge)
    for step, step_lrs in enumerate(lrs, start=1):
        for lr, edge in zip(step_lrs, holds_edge):
            peak, final = (edge_peak, edge_final) if edge else (LR, MIN_LR)
            want = expected_lr(min(step, ITERS), optim.lr_warmup_init, peak, final, optim.lr_decay_style)
            assert lr == pytest.approx(want, rel=1e-12, abs=1e-15), (step, edge)
