"""Jobs on the local SLURM cluster: render a template of scripts/slurm/ with its own CLI, submit
it with sbatch, watch its output, read its final state from `scontrol show job`, and read the
checkpoints it wrote."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron_ext.checkpointing import torch_dist as ckpt

REPO = Path(__file__).resolve().parents[2]
SLURM_DIR = REPO / "scripts" / "slurm"
TASKS = 2  # ranks per job: the two cores of a CI machine, one CPU each
# A tiny model on megatron's mock data (nothing to build or read), one CPU per rank.
TINY = [
    "experiment=none",
    "launcher.device=cpu",
    "data.mock=true",
    "model.seq_length=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.eval_interval=0",
    "logging.progress_bar=false",
    "logging.log_interval=1",
]
# Every job submitted by this test session, so that a failed test's job does not hold the node.
SUBMITTED: list["Job"] = []
FINAL_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
    "BOOT_FAIL", "DEADLINE",
}


def job_environment(slurm_conf: str) -> dict[str, str]:
    """What sbatch hands the job (it exports the submitter's environment): this cluster, this
    Python and torchrun first on PATH, this checkout first on the import path."""
    # Not what an earlier test, or a SLURM job running pytest itself, left in this environment.
    leftovers = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {
        name: value for name, value in os.environ.items()
        if name not in leftovers and not name.startswith(("SLURM_", "SBATCH_", "SRUN_", "TORCHELASTIC_"))
    }
    env["SLURM_CONF"] = slurm_conf
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    return env


@dataclass
class Job:
    id: str
    workdir: Path
    env: dict[str, str]

    @property
    def output_file(self) -> Path:
        return self.workdir / f"megatron_ext-{self.id}.out"  # the templates' --output=%x-%j.out

    def output(self) -> str:
        return self.output_file.read_text() if self.output_file.exists() else ""

    def slurm(self, *command: str) -> str:
        done = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{' '.join(command)}: {done.stderr.strip()}"
        return done.stdout

    def info(self) -> dict[str, str]:
        """`scontrol show job` as a dict: JobState, ExitCode, Restarts, ..."""
        text = self.slurm("scontrol", "show", "job", "--oneliner", self.id)
        return dict(re.findall(r"(\S+?)=(\S*)", text))

    def wait_for_output(self, pattern: str, timeout: float = 180) -> None:
        """Until the job's output matches `pattern` (the job must still be running)."""
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.output(), re.MULTILINE):
            state = self.info()["JobState"]
            assert state not in FINAL_STATES, f"job {self.id} ended {state} before /{pattern}/:\n{self.output()[-3000:]}"
            assert time.monotonic() < deadline, f"no /{pattern}/ after {timeout} s:\n{self.output()[-3000:]}"
            time.sleep(0.5)

    def wait_for_state(self, state: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while (now := self.info()["JobState"]) != state:
            assert time.monotonic() < deadline, f"job {self.id} still {now}, not {state}, after {timeout} s"
            time.sleep(0.2)

    def wait_until_done(self, timeout: float = 300) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while (info := self.info())["JobState"] not in FINAL_STATES:
            assert time.monotonic() < deadline, f"job {self.id} still {info['JobState']} after {timeout} s"
            time.sleep(0.5)
        return info


def submit(
    slurm_conf: str,
    workdir: Path,
    template: str,
    overrides: Sequence[str],
    time_limit: str = "10",
) -> Job:
    """Render `template` as a user would (scripts/slurm/render.py, TASKS GPUs of one CPU each on
    one node) and submit it with sbatch from `workdir`."""
    workdir.mkdir(parents=True, exist_ok=True)
    script = workdir / f"{template}.sbatch"
    render = [
        sys.executable, str(SLURM_DIR / "render.py"), template, "--nodes", "1",
        "--gpus-per-node", str(TASKS), "--cpus-per-gpu", "1", "--time", time_limit,
        *TINY, *overrides, "-o", str(script),
    ]
    subprocess.run(render, check=True, capture_output=True, timeout=60)
    env = job_environment(slurm_conf)
    done = subprocess.run(
        ["sbatch", "--parsable", str(script)], cwd=workdir, env=env, capture_output=True,
        text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    job = Job(done.stdout.strip().split(";")[0], workdir, env)
    SUBMITTED.append(job)
    return job


def cancel_submitted() -> None:
    while SUBMITTED:
        job = SUBMITTED.pop()
        subprocess.run(["scancel", "--quiet", job.id], env=job.env, capture_output=True, timeout=60)


def checkpoint_tensors(root: Path, iteration: int) -> dict[str, torch.Tensor]:
    """Every tensor of checkpoint `iteration` under `root` (model, optimizer), read back in full
    by torch's own reader: a missing or truncated shard fails here."""
    with tempfile.TemporaryDirectory() as scratch:
        whole = Path(scratch) / "whole.pt"
        dcp_to_torch_save(ckpt.iteration_dir(root, iteration), whole)
        state = torch.load(whole, weights_only=False)
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}


def assert_complete_checkpoint(root: Path) -> int:
    """The tracker names a checkpoint that every rank wrote, and no save was left half-done;
    returns its iteration."""
    iteration = ckpt.latest_iteration(root)
    assert iteration is not None, f"no checkpoint tracker in {root}"
    folder = ckpt.iteration_dir(root, iteration)
    assert len(list(folder.glob("*.distcp"))) == TASKS, f"{folder}: not one shard file per rank"
    assert not list(root.glob(".iter_*.tmp")), f"{root}: a save was left half-done"
    assert checkpoint_tensors(root, iteration), f"{folder}: no tensors"
    return iteration


def assert_bitwise_equal(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == reference.keys()
    different = [name for name in reference if not torch.equal(ours[name], reference[name])]
    assert not different, f"{len(different)} of {len(reference)} tensors differ, e.g. {different[:3]}"
