"""Megatron-LM's --test-mode (train.test_mode): megatron-core's real-time test runs in every
attention forward of a training step and stops the run when the tensor-parallel replicas of a
QK-norm differ (as silent memory corruption would leave them).

Two ranks at TP=2 train a tiny model with QK-norms (LayerNorm: megatron's test reads their
biases). One step trains; then rank 1's copy of a QK-norm weight is changed, and the next step
stops on both ranks with megatron's message naming the parameter and the TP ranks. Without the
test mode the same change trains on unnoticed.

This file is also the worker script the ranks run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest


def config(test_mode: bool, cache: str):
    from megatron_ext.config.schema import (
        Config,
        DataConfig,
        LoggingConfig,
        ModelConfig,
        ParallelConfig,
        TrainConfig,
    )

    return Config(
        model=ModelConfig(
            num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, seq_length=32,
            qk_layernorm=True, normalization="LayerNorm",
        ),
        parallel=ParallelConfig(tp=2),
        data=DataConfig(cache_dir=cache),
        train=TrainConfig(iters=2, micro_batch_size=2, global_batch_size=2, eval_interval=0, test_mode=test_mode),
        logging=LoggingConfig(progress_bar=False),
    )


def steps_with_a_corrupt_replica(test_mode: bool, cache: str) -> dict:
    """One clean step, then one after rank 1's first q_layernorm weight has changed: what each
    step gave (its loss or the error that stopped it)."""
    import torch
    import torch.distributed as dist

    from megatron_ext.config.validate import validate
    from megatron_ext.training.trainer import Trainer

    cfg = config(test_mode, cache)
    validate(cfg, dist.get_world_size(), "cpu")
    trainer = Trainer(cfg)
    trainer.setup()
    outcome = {"clean": trainer.train_step_with_loss()["loss"]}
    norm = next(p for name, p in trainer.model[0].named_parameters() if "q_layernorm.weight" in name)
    with torch.no_grad():
        norm[0] += dist.get_rank()
    try:
        outcome["corrupt"] = trainer.train_step_with_loss()["loss"]
    except AssertionError as stopped:  # megatron's real-time test
        outcome["corrupt"] = str(stopped)
    trainer.close()
    return outcome


def worker(out_dir: str) -> None:
    import torch.distributed as dist

    from megatron_ext.platform.launch import join_world

    join_world("cpu")
    cache = str(Path(out_dir, "cache"))
    report = {mode: steps_with_a_corrupt_replica(mode == "on", cache) for mode in ("on", "off")}
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(sys.argv[1])


# --- the test ------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_test_mode_stops_on_a_differing_qk_norm_replica(tmp_path):
    from _torchrun import rank_reports, torchrun

    torchrun(__file__, 2, str(tmp_path))
    for rank in rank_reports(tmp_path, 2):
        assert isinstance(rank["on"]["clean"], float) and isinstance(rank["off"]["clean"], float)
        assert rank["on"]["clean"] == rank["off"]["clean"]  # the test changes nothing it checks
        assert "Discrepancy between q_w in TP ranks" in rank["on"]["corrupt"], rank["on"]["corrupt"]
        assert isinstance(rank["off"]["corrupt"], float), rank["off"]["corrupt"]
