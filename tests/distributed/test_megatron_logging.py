"""Megatron-LM's logging switches, read back from TensorBoard's event files and checked against
references computed here: the parameter norm against the full parameters gathered from the
run's checkpoint (whatever the TP / PP layout that trained them), the zeros in the gradients
against a direct count of the gradient buffers, the perplexity against exp(loss)."""

from __future__ import annotations

import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron_ext.config.schema import ModelConfig
from megatron_ext.train import run_from_overrides
from megatron_ext.checkpointing import torch_dist as ckpt
from megatron_ext.training.flops import flops_per_iteration
from megatron_ext.training.trainer import Trainer

pytestmark = pytest.mark.distributed

COMMON = [
    "experiment=none",
    "train.iters=3",
    "model.seq_length=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "logging.progress_bar=false",
]
SWITCHES = [
    "logging.log_params_norm=true",
    "logging.log_num_zeros_in_grad=true",
    "logging.log_throughput=true",
    "logging.log_timers_to_tensorboard=true",
    "logging.log_memory_to_tensorboard=true",
    "logging.log_validation_ppl_to_tensorboard=true",
]


def _scalars(tb_dir) -> EventAccumulator:
    events = EventAccumulator(str(tb_dir))
    events.Reload()
    return events


def test_switches_write_their_tags(tmp_path):
    tb = tmp_path / "tb"
    overrides = [*COMMON, "train.eval_interval=3", "train.eval_iters=1", f"data.cache_dir={tmp_path / 'cache'}"]
    run_from_overrides([*overrides, f"logging.tensorboard_dir={tmp_path / 'plain'}"])
    run_from_overrides([*overrides, f"logging.tensorboard_dir={tb}", *SWITCHES])

    expected = {
        "train/params_norm", "train/num_zeros_in_grad", "train/throughput",
        "timers/iteration-time", "timers/forward-backward-time", "timers/optimizer-time",
        # the CPU's honest numbers: the reporting process's resident set and its peak
        "memory/rss_bytes", "memory/max_rss_bytes",
        "eval/ppl",
    }
    assert expected <= set(_scalars(tb).Tags()["scalars"])
    assert not expected & set(_scalars(tmp_path / "plain").Tags()["scalars"])
    events = _scalars(tb)
    # TFLOP/s per rank: Megatron-LM's count of one iteration's operations over its time.
    flops = flops_per_iteration(ModelConfig(seq_length=32), 384, 4)  # the byte vocabulary, padded
    times = {e.step: e.value for e in events.Scalars("timers/iteration-time")}
    for e in events.Scalars("train/throughput"):
        assert e.value == pytest.approx(flops / (times[e.step] * 1e12), rel=1e-5)
    assert all(e.value > 2**20 for e in events.Scalars("memory/rss_bytes"))
    (loss,), (ppl,) = events.Scalars("eval/loss"), events.Scalars("eval/ppl")
    assert ppl.value == pytest.approx(math.exp(loss.value), rel=1e-6)


def _model_tensors(checkpoint_dir, out) -> list[torch.Tensor]:
    """The full (unsharded) model tensors of a torch_dist checkpoint, read without megatron."""
    dcp_to_torch_save(str(checkpoint_dir), str(out))
    state = torch.load(out, weights_only=False)
    return [
        value for key, value in state.items()
        if torch.is_tensor(value) and "optimizer." not in key and not key.startswith("rng_state")
        and "_extra_state" not in key
    ]


# name -> (layout overrides, workers)
LAYOUTS = {
    "tp2": (["parallel.tp=2"], 2),
    # Tied embeddings: the last stage's output-layer copy is counted once, with the first's.
    "pp2": (["parallel.pp=2"], 2),
    # Expert weights: each rank holds half of the experts, summed over the expert group.
    "moe_ep2": (["model.num_experts=4", "parallel.ep=2"], 2),
    "tp2_pp2": pytest.param((["parallel.tp=2", "parallel.pp=2"], 4), marks=pytest.mark.slow),
}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_params_norm_equals_norm_of_gathered_parameters(tmp_path, layout):
    overrides, workers = layout
    tb, root = tmp_path / "tb", tmp_path / "ckpt"
    run_from_overrides([
        *COMMON, *overrides, f"launcher.nproc={workers}", "train.eval_interval=0",
        f"data.cache_dir={tmp_path / 'cache'}", f"logging.tensorboard_dir={tb}",
        "logging.log_params_norm=true", f"checkpoint.save={root}",
    ])
    logged = _scalars(tb).Scalars("train/params_norm")[-1]
    params = _model_tensors(ckpt.iteration_dir(root, 3), tmp_path / "full.pt")
    reference = math.sqrt(sum(float(p.double().square().sum()) for p in params))
    assert logged.step == 3
    assert logged.value == pytest.approx(reference, rel=1e-6)


def test_num_zeros_in_grad_equals_direct_count(tmp_path, monkeypatch):
    """Untied embeddings: the rows of tokens absent from a batch get exactly zero gradient."""
    counted = []
    real_step = Trainer.train_step

    def step_and_count(trainer):
        metrics = real_step(trainer)
        # DDP's fp32 gradient buffers hold the step's gradients until the next step zeroes them.
        grads = [p.main_grad for m in trainer.model for p in m.module.parameters()]
        counted.append((metrics["num_zeros_in_grad"], sum(int((g == 0).sum()) for g in grads)))
        return metrics

    monkeypatch.setattr(Trainer, "train_step", step_and_count)
    run_from_overrides([
        *COMMON, "train.eval_interval=0", f"data.cache_dir={tmp_path / 'cache'}",
        "model.tie_embeddings=false", "logging.log_num_zeros_in_grad=true",
    ])
    assert len(counted) == 3
    for reported, direct in counted:
        assert direct > 0
        assert reported == direct
