"""SIGUSR1 (SLURM's warning before the time limit) stops training at the next step boundary
with a checkpoint of that step, from which the run resumes exactly."""

from __future__ import annotations

import os
import signal

import pytest

from megatron_ext.plugin import Plugin, register_plugin
from megatron_ext.train import run_from_overrides
from megatron_ext.checkpointing import torch_dist as ckpt

pytestmark = pytest.mark.distributed

COMMON = [
    "experiment=none",
    "train.iters=5",
    "train.eval_interval=0",
    "logging.progress_bar=false",
    "model.seq_length=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
]


@register_plugin
class SignalAtStepTwo(Plugin):
    """Plays the cluster: signals this process in the middle of step 2."""

    name = "test_signal_at_step_two"

    def on_step_begin(self, trainer, step):
        if step == 2:
            os.kill(os.getpid(), signal.SIGUSR1)


def test_sigusr1_checkpoints_and_stops(tmp_path):
    cache, root = f"data.cache_dir={tmp_path / 'cache'}", tmp_path / "ckpt"
    uninterrupted = run_from_overrides([*COMMON, cache])["losses"]

    stopped = run_from_overrides(
        [*COMMON, cache, f"checkpoint.save={root}", f"plugins=[{SignalAtStepTwo.name}]"]
    )["losses"]
    assert stopped == uninterrupted[:2]
    assert ckpt.latest_iteration(root) == 2

    resumed = run_from_overrides([*COMMON, cache, f"checkpoint.load={root}"])["losses"]
    assert resumed == uninterrupted[2:]
