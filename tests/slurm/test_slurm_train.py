"""The sbatch templates under a real SLURM (the local cluster): both train two ranks and
checkpoint, to the same bits; a job that SLURM requeues mid-run resumes from the checkpoint its
ranks saved on the requeue's SIGTERM and ends with the bits of a run never interrupted."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.slurm._jobs import (
    assert_bitwise_equal,
    assert_complete_checkpoint,
    checkpoint_tensors,
    submit,
)

pytestmark = pytest.mark.slurm

ITERS = 80  # enough steps for a requeue to land mid-run


def train_overrides(root: Path) -> list[str]:
    # The resume-if-present idiom: the same command line starts the run and resumes it.
    return [
        f"train.iters={ITERS}",
        f"checkpoint.save={root}",
        f"checkpoint.load={root}",
        "checkpoint.load_optional=true",
        "checkpoint.keep_last=null",
    ]


def logged_losses(output: str) -> dict[int, str]:
    return {int(i): loss for i, loss in re.findall(r"^iter +(\d+)/\d+ \| loss (\S+)", output, re.M)}


@pytest.fixture(scope="module")
def srun_run(slurm_conf, tmp_path_factory) -> tuple[Path, str]:
    """Checkpoint root and output of an uninterrupted train_srun job."""
    workdir = tmp_path_factory.mktemp("train_srun")
    job = submit(slurm_conf, workdir, "train_srun", train_overrides(workdir / "ckpt"))
    info = job.wait_until_done()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), job.output()[-3000:]
    return workdir / "ckpt", job.output()


def test_train_srun_trains_and_checkpoints(srun_run):
    root, output = srun_run
    assert assert_complete_checkpoint(root) == ITERS
    losses = logged_losses(output)
    assert sorted(losses) == list(range(1, ITERS + 1))
    assert float(losses[ITERS]) < float(losses[1])


def test_train_multinode_trains_like_train_srun(slurm_conf, tmp_path, srun_run):
    """torchrun under srun forms the same world as one srun task per rank: the same bits."""
    job = submit(slurm_conf, tmp_path, "train_multinode", train_overrides(tmp_path / "ckpt"))
    info = job.wait_until_done()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), job.output()[-3000:]
    assert assert_complete_checkpoint(tmp_path / "ckpt") == ITERS
    assert_bitwise_equal(
        checkpoint_tensors(tmp_path / "ckpt", ITERS), checkpoint_tensors(srun_run[0], ITERS)
    )


# Under -m slow while a flake is traced: about one run in four here ends with every tensor
# different from the uninterrupted run's (seen 2026-12-02, 1 of 4 runs on main and 1 of 2 CI runs).
@pytest.mark.slow
def test_requeued_job_resumes_bitwise(slurm_conf, tmp_path, srun_run):
    root = tmp_path / "ckpt"
    job = submit(slurm_conf, tmp_path, "train_srun", train_overrides(root))
    job.wait_for_output(r"^iter +2/")
    job.slurm("scontrol", "requeue", job.id)
    # SLURM holds a requeued job back for a while (BeginTime); let it start again now.
    job.wait_for_state("PENDING")
    job.slurm("scontrol", "update", f"JobId={job.id}", "StartTime=now")
    info = job.wait_until_done()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), job.output()[-3000:]

    saved = sorted(int(p.name.removeprefix("iter_")) for p in root.glob("iter_*"))
    assert len(saved) == 2 and 2 <= saved[0] < ITERS, f"no checkpoint from the requeue's SIGTERM: {saved}"
    assert assert_complete_checkpoint(root) == ITERS
    losses, reference = logged_losses(job.output()), logged_losses(srun_run[1])
    # The second start went on from the first one's checkpoint, not from scratch.
    assert min(losses) > saved[0]
    # Where the runs part, if they do: the first iteration whose logged loss differs.
    parted = next((i for i in sorted(losses) if losses[i] != reference[i]), None)
    assert parted is None, f"resumed from {saved[0]}; losses differ from iteration {parted}:\n{job.output()[-3000:]}"
    assert_bitwise_equal(checkpoint_tensors(root, ITERS), checkpoint_tensors(srun_run[0], ITERS))
