"""NaN at a step of a run, under each train.nan_policy.

The table: a NaN at step STEP in one rank's loss, in one rank's gradient, or in one sample of
the data (tests/faults/_faults.py's `nan` plugin), at DP=2 and TP=2xPP=2, the run saving every
INTERVAL steps. What must hold:

- `stop`: exit 1 and, last on stderr, one line naming the iteration, what was not finite, the
  ranks it arose on (not the replicas the data-parallel reduction spread it to) and the
  checkpoint kept; the tracker stays at the checkpoint before the fault, bitwise the clean
  run's, nothing newer is written and no staging folder is left.
- `rollback`: exit 0 and one note naming the same, the checkpoint gone back to and the samples
  passed over; the run finishes at ROLLBACK_END with finite weights, the samples passed over
  counted in its checkpoints, the learning rate the clean run's scaled by rollback_lr_scale,
  and the checkpoint gone back to untouched (bitwise the clean run's). A poisoned sample is
  never read again: one rollback is all it takes.

Then a run that diverges by itself (`optim.lr=1e6`, one process): `stop` applies no non-finite
step and keeps a finite checkpoint; `rollback` finishes finite and a resume of it goes on from
the data position after the samples it passed over.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megatron_ext.checkpointing import tracker
from megatron_ext.checkpointing.torch_dist import load_common
from megatron_ext.train import main, run_from_overrides
from megatron_ext.training.numerics import Fault, LossSpikes
from tests.distributed._checkpoint_tensors import checkpoint_tensors
from tests.faults._job import Job
from tests.faults._runs import BASE, FAULT_PLUGINS, LAYOUTS, assert_bitwise, learning_rates, staging_folders, steps_logged

STEP, INTERVAL, ROLLBACK_END = 3, 2, 4
GLOBAL_BATCH = 2  # BASE's: step STEP reads samples 4 and 5, one per micro-batch
LR_SCALE = 0.5  # train.rollback_lr_scale's default


@dataclasses.dataclass(frozen=True)
class NanCase:
    where: str  # nan.where
    layout: str  # a key of LAYOUTS
    settings: tuple[str, ...]  # the nan plugin's other settings
    fault: str  # what the run says of it


CASES = {
    # rank 1's last token loss is NaN; its gradients stay finite, the step is applied
    "loss of rank 1, DP=2": NanCase("loss", "DP=2", ("nan.rank=1",), "loss nan on rank 1"),
    # the word embedding's gradient on rank 1 (rank 0's replica gets the NaN in the reduction)
    "grad of rank 1, DP=2": NanCase("grad", "DP=2", ("nan.rank=1",), "gradient norm nan on rank 1"),
    # sample 5 is DP rank 1's micro-batch of step 3
    "data of rank 1, DP=2": NanCase("data", "DP=2", ("nan.sample=5",), "gradient norm nan on rank 1"),
    # rank 3 is on the last pipeline stage, which computes the loss; its TP peer's loss is finite
    "loss of rank 3, TP=2xPP=2": NanCase("loss", "TP=2xPP=2", ("nan.rank=3",), "loss nan on rank 3"),
    # the word embedding's on stage 0 (the output layer of rank 3 is tied to it: reduced together)
    "grad of rank 1, TP=2xPP=2": NanCase("grad", "TP=2xPP=2", ("nan.rank=1",), "gradient norm nan on rank 1"),
    # every rank reads the sample (dp=1): the last stage's NaN loss flows back through both stages
    "data, TP=2xPP=2": NanCase("data", "TP=2xPP=2", ("nan.sample=5",), "gradient norm nan on rank 0, 1, 2, 3"),
}
DEFAULT = ("grad of rank 1, DP=2", "stop")  # the one of the default suite; the others: -m slow


def _params() -> list:
    return [
        pytest.param(CASES[name], policy, id=f"{name}, {policy}",
                     marks=() if (name, policy) == DEFAULT else pytest.mark.slow)
        for name in CASES
        for policy in ("stop", "rollback")
    ]


@pytest.mark.distributed
@pytest.mark.parametrize("case, policy", _params())
def test_a_nan_stops_or_rolls_back_to_the_clean_runs_checkpoint(case, policy, clean, cache, tmp_path):
    root = tmp_path / "ckpt"
    job = Job(
        [*BASE, *LAYOUTS[case.layout].overrides("nan"), cache, f"checkpoint.save={root}",
         f"checkpoint.interval={INTERVAL}", f"train.nan_policy={policy}", f"train.exit_interval={ROLLBACK_END}",
         f"nan.where={case.where}", f"nan.step={STEP}", *case.settings],
        **FAULT_PLUGINS,
    )
    rc = job.wait()
    if policy == "stop":
        assert rc == 1, job.output[-4000:]
        assert job.errors[-1] == (
            f"error: iteration {STEP}: {case.fault}: stopped without saving "
            f"(the newest checkpoint is iteration {INTERVAL} of {root})"
        ), job.output[-4000:]
        assert tracker.saved_iterations(root) == [INTERVAL] and tracker.latest_iteration(root) == INTERVAL
        assert steps_logged(job.output) == list(range(1, STEP))
    else:
        assert rc == 0, job.output[-4000:]
        skipped = f"{(STEP - 1) * GLOBAL_BATCH}-{STEP * GLOBAL_BATCH - 1}"
        assert [line for line in job.lines if line.startswith("rollback")] == [
            f"rollback 1/3: iteration {STEP}: {case.fault}; back to iteration {INTERVAL}, samples {skipped} skipped, "
            f"lr x{LR_SCALE:g}\n"
        ], job.output[-4000:]
        assert steps_logged(job.output) == list(range(1, ROLLBACK_END + 1))
        assert tracker.saved_iterations(root) == [INTERVAL, ROLLBACK_END]  # checkpoint.keep_last=2
        common = load_common(root, ROLLBACK_END)
        assert common["skipped_samples"] == GLOBAL_BATCH
        assert common["consumed_samples"] == (ROLLBACK_END + 1) * GLOBAL_BATCH
        tensors = checkpoint_tensors(root, ROLLBACK_END, tmp_path / "last.pt")
        assert all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point())
        clean_lrs = learning_rates(clean(case.layout).output)
        assert learning_rates(job.output)[INTERVAL:] == pytest.approx(
            [LR_SCALE * lr for lr in clean_lrs[INTERVAL:ROLLBACK_END]], rel=1e-3
        )
    assert "Traceback" not in job.output and not staging_folders(root)
    assert_bitwise(root, INTERVAL, clean(case.layout).root, tmp_path)


# --- a run that diverges by itself -----------------------------------------------------------

DIVERGING = ["experiment=none", "launcher.nproc=1", "launcher.device=cpu", "optim.lr=1e6", "optim.min_lr=1e5",
             "train.iters=8", "train.eval_interval=4", "logging.progress_bar=false"]


def test_stop_applies_no_nonfinite_step_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    save = tmp_path / "ckpt"
    with pytest.raises(SystemExit) as exit_:
        main([*DIVERGING, "checkpoint.interval=1", f"checkpoint.save={save}", f"data.cache_dir={tmp_path}/cache"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 1 and len(err) == 1, err
    latest = tracker.latest_iteration(save)
    assert err[0] == (f"error: iteration {latest + 1}: gradient norm nan on rank 0: stopped without saving "
                      f"(the newest checkpoint is iteration {latest} of {save})")
    tensors = checkpoint_tensors(save, latest, tmp_path / "scratch.pt")
    assert tensors and all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point())
    assert not list(save.glob(".iter_*"))  # nothing half-written


@pytest.mark.slow  # the default suite rolls back nothing: its NaN case stops (the table above)
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
