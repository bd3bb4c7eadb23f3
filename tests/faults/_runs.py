"""What the fault tables share: the layouts a fault is injected in, the run every case starts
from, and the checks of a checkpoint directory after a fault (its tracker, no staging folder
left, its checkpoints bitwise those of a clean run).

Every faulted run is BASE in one of LAYOUTS, with the fault plugins of tests/faults/_faults.py
loadable; the clean run of a layout (conftest.py's `clean`) is the same run without a fault,
stopped by `train.exit_interval` after CLEAN_STEPS steps with a checkpoint at each one. The
learning-rate schedule spans BASE's `train.iters` whatever ends a run, so a faulted run's
checkpoint of iteration i is bitwise the clean run's of iteration i.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from pathlib import Path
from typing import Iterator

import psutil
import torch

from megatron_ext.checkpointing import tracker
from tests.distributed._checkpoint_tensors import checkpoint_tensors
from tests.faults._job import Job

# A run that a signal, a fault or train.exit_interval ends: a step line each step.
BASE = (
    "experiment=none",
    "train.iters=1000",
    "train.eval_interval=0",
    "logging.progress_bar=false",
    "logging.log_interval=1",
    "model.seq_length=32",
    "train.micro_batch_size=1",
    "train.global_batch_size=2",
)
# Six steps with a checkpoint every three: a run that saves mid-way and at its end.
SAVES_TWICE = [
    "experiment=none",
    "train.iters=6",
    "train.eval_interval=0",
    "logging.progress_bar=false",
    "model.seq_length=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "checkpoint.interval=3",
]
CLEAN_STEPS = 8
# What makes a run load tests/faults/_faults.py's plugins (Job's environment).
FAULT_PLUGINS = {"MEGATRON_EXT_PLUGINS": "tests.faults._faults"}


@dataclasses.dataclass(frozen=True)
class Layout:
    settings: tuple[str, ...]
    plugins: tuple[str, ...] = ()

    def overrides(self, *plugins: str) -> list[str]:
        """The layout's settings, with `plugins` (the faults') before its own."""
        names = [*plugins, *self.plugins]
        return [*self.settings, f"plugins=[{','.join(names)}]"] if names else list(self.settings)


RESHARD_STEP = 3  # the step before which the reshard layout moves
LAYOUTS = {
    "DP=2": Layout(("launcher.nproc=2", "parallel.dp=2")),
    "TP=2xPP=2": Layout(("launcher.nproc=4", "parallel.tp=2", "parallel.pp=2")),
    # A worker pool at TP2 x PP2 that moves to TP1 x PP2 x DP2 live, before step RESHARD_STEP.
    "reshard mid-move": Layout(
        ("launcher.nproc=4", "parallel.tp=2", "parallel.pp=2",
         f"reshard.schedule=[{{step: {RESHARD_STEP}, layout: {{tp: 1, pp: 2, dp: 2}}}}]"),
        ("reshard",),
    ),
}


@dataclasses.dataclass(frozen=True)
class CleanRun:
    root: Path  # its checkpoints, one a step
    output: str


def staging_folders(root: Path) -> list[str]:
    """The staging folders of saves under `root` that were never published."""
    return sorted(p.name for p in root.glob(".iter_*.tmp"))


def steps_logged(output: str) -> list[int]:
    return [int(s) for s in re.findall(r"^iter\s+(\d+)/", output, re.M)]


def learning_rates(output: str) -> list[float]:
    """The learning rate of each step line, in order."""
    return [float(lr) for lr in re.findall(r"^iter\s+\d+/.*?\| lr (\S+) \|", output, re.M)]


def assert_bitwise(root: Path, iteration: int, clean_root: Path, scratch: Path) -> None:
    """Every tensor of checkpoint `iteration` under `root` (weights, optimizer states) equals
    the clean run's of the same iteration bit for bit."""
    assert iteration in tracker.saved_iterations(clean_root), f"the clean run has no checkpoint {iteration}"
    got = checkpoint_tensors(root, iteration, scratch / "got.pt")
    want = checkpoint_tensors(clean_root, iteration, scratch / "want.pt")
    assert got.keys() == want.keys()
    differ = [key for key in want if not torch.equal(got[key], want[key])]
    assert not differ, f"checkpoint {iteration} differs from the clean run's in {differ[:5]}"


@contextlib.contextmanager
def held_in_a_save(job: Job, root: Path) -> Iterator[tuple[int, list[psutil.Process]]]:
    """The job's workers held still (SIGSTOP) while a save under `root` after a published one is
    unfinished: held as soon as a staging folder appears, until one is found there (a save that
    finished meanwhile: let go, and wait for the next). Yields the tracker's iteration and the
    workers by start order (rank 0 first); lets the living ones go at the end."""

    def in_a_save() -> bool:
        return bool(staging_folders(root)) and tracker.latest_iteration(root) is not None

    while True:
        job.wait_until(in_a_save, "a save", poll_s=0.001)
        workers = sorted(job.workers, key=lambda p: p.create_time())
        for worker in workers:
            worker.suspend()
        if in_a_save():
            break
        for worker in workers:
            worker.resume()
    try:
        yield tracker.latest_iteration(root), workers
    finally:
        for worker in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                worker.resume()
