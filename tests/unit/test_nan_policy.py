"""A diverging run (`optim.lr=1e6`) under train.nan_policy: `stop` applies no non-finite step,
saves nothing after it, keeps a finite checkpoint as the tracker's and ends in one line, exit 1;
`rollback` goes back to a finite checkpoint, passes over the samples since, lowers the lr and
finishes with a finite loss, and a resume of it goes on from the data position after them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron_ext.checkpointing.torch_dist import iteration_dir, latest_iteration, load_common
from megatron_ext.train import main, run_from_overrides
from megatron_ext.training.numerics import Fault, LossSpikes

DIVERGING = ["experiment=none", "launcher.nproc=1", "launcher.device=cpu", "optim.lr=1e6", "optim.min_lr=1e5",
             "train.iters=8", "train.eval_interval=4", "logging.progress_bar=false"]


def _finite_checkpoint(root: Path, iteration: int, scratch: Path) -> bool:
    dcp_to_torch_save(iteration_dir(root, iteration), scratch)
    tensors = [v for v in torch.load(scratch, weights_only=False).values() if isinstance(v, torch.Tensor)]
    return bool(tensors) and all(torch.isfinite(t).all() for t in tensors if t.is_floating_point())


def test_stop_applies_no_nonfinite_step_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    save = tmp_path / "ckpt"
    with pytest.raises(SystemExit) as exit_:
        main([*DIVERGING, "checkpoint.interval=1", f"checkpoint.save={save}", f"data.cache_dir={tmp_path}/cache"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 1 and len(err) == 1, err
    latest = latest_iteration(save)
    assert err[0] == (f"error: iteration {latest + 1}: gradient norm nan on rank 0: stopped without saving "
                      f"(the newest checkpoint is iteration {latest} of {save})")
    assert _finite_checkpoint(save, latest, tmp_path / "scratch.pt")
    assert not list(save.glob(".iter_*"))  # nothing half-written


def test_rollback_finishes_finite_and_resumes_after_the_skipped_samples(tmp_path):
    save, cache = tmp_path / "ckpt", f"data.cache_dir={tmp_path}/cache"
    rollback = [*DIVERGING, "checkpoint.interval=4", f"checkpoint.save={save}", cache, "train.nan_policy=rollback",
                "train.rollback_lr_scale=1e-7"]
    done = run_from_overrides(rollback)
    assert math.isfinite(done["final_loss"]) and math.isfinite(done["eval_loss"])
    rollbacks = [n for n in done["notes"] if n.startswith("rollback ")]
    assert len(rollbacks) == 1 and "back to iteration 0" in rollbacks[0] and "skipped, lr x1e-07" in rollbacks[0]
    common = load_common(save, 8)
    assert common["iteration"] == 8 and common["skipped_samples"] > 0
    assert common["consumed_samples"] == 8 * 16 + common["skipped_samples"]  # the data went on past them
    assert common["args"].skipped_train_samples == common["skipped_samples"]  # Megatron-LM's counter
    resumed = run_from_overrides([*rollback, "train.iters=10", f"checkpoint.load={save}"])
    assert math.isfinite(resumed["final_loss"]) and len(resumed["losses"]) == 2
    assert load_common(save, 10)["consumed_samples"] == common["consumed_samples"] + 2 * 16


def test_loss_spikes_against_the_running_mean():
    spikes = LossSpikes(factor=3.0, window=4)
    for i, loss in enumerate([2.0, 2.2, 1.8, 2.0, 5.9]):
        spikes.check(i, loss, i * 8)
    # 5.9 was below 3 x 2.0; the mean is now 2.975 (the last four), and 9.0 is above 8.925
    with pytest.raises(Fault, match=r"^iteration 5: loss 9 above 3 x the mean 2.975 of the last 4 steps$"):
        spikes.check(5, 9.0, 40)
    with pytest.raises(Fault) as fault:
        LossSpikes(factor=None, window=4).check(2, float("nan"), 16)
    assert (fault.value.iteration, fault.value.what, fault.value.consumed_samples) == (2, "loss nan", 16)
