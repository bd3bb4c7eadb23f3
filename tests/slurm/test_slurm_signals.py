"""Pre-emption as SLURM delivers it, to the rendered templates on the local cluster: the
`--signal=USR1@90` warning before the time limit, `scancel --signal` (TERM, INT) to the job's
steps, and a plain `scancel` (SIGTERM to every process of the job, batch shell and srun
included). Each ends with a complete checkpoint, and a job whose processes all exit 0 ends
COMPLETED.

A plain `scancel` (no --signal) is a cancellation: SLURM records CANCELLED whatever the job's
exit code, so there the check is the checkpoint saved between its SIGTERM and the SIGKILL
KillWait seconds later."""

from __future__ import annotations

import re

import pytest

from tests.slurm._jobs import Job, assert_complete_checkpoint, submit

pytestmark = pytest.mark.slurm

TEMPLATES = ["train_srun", "train_multinode"]


def time_limit_warning(job: Job) -> None:
    """Bring the time limit to within 60-120 s: the template's --signal=USR1@90 comes at
    slurmctld's next periodic check (every 30 s; SLURM may send it up to that much early)."""
    hours, minutes, seconds = (int(x) for x in re.split("[:-]", job.info()["RunTime"])[-3:])
    elapsed_minutes = hours * 60 + minutes + seconds / 60
    job.slurm("scontrol", "update", f"JobId={job.id}", f"TimeLimit={int(elapsed_minutes) + 2}")


def scancel(*options: str):
    return lambda job: job.slurm("scancel", *options, job.id)


# (how the job is stopped, the state SLURM must record)
STOPS = {
    "usr1_warning": (time_limit_warning, "COMPLETED"),
    "scancel_signal_term": (scancel("--signal=TERM"), "COMPLETED"),
    "scancel_signal_int": (scancel("--signal=INT"), "COMPLETED"),
    "scancel": (scancel(), "CANCELLED"),
}
# The default suite's share: the templates' own warning, through torchrun, whose workers must
# save while it waits (train_srun's ranks save on SIGTERM in the requeue test). The rest: -m slow.
QUICK = {("train_multinode", "usr1_warning")}


def cases():
    for template in TEMPLATES:
        for stop in STOPS:
            marks = () if (template, stop) in QUICK else (pytest.mark.slow,)
            yield pytest.param(template, stop, marks=marks, id=f"{template}-{stop}")


@pytest.mark.parametrize("template, stop", cases())
def test_stopped_job_saves_complete_checkpoint(slurm_conf, tmp_path, template, stop):
    deliver, final_state = STOPS[stop]
    root = tmp_path / "ckpt"
    # Far more iterations than the job gets to: only the signal ends it.
    job = submit(slurm_conf, tmp_path, template, ["train.iters=100000", f"checkpoint.save={root}"])
    job.wait_for_output(r"^iter +2/")
    deliver(job)
    info = job.wait_until_done(timeout=240)
    assert info["JobState"] == final_state, job.output()[-3000:]
    if final_state == "COMPLETED":
        assert info["ExitCode"] == "0:0"
    assert assert_complete_checkpoint(root) >= 2, job.output()[-3000:]
