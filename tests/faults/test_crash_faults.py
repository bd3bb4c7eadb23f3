"""A worker that dies during a save, or a save that dies half-way: the previous checkpoint stays
the tracker's and loadable, nothing half-written is trusted, and the next run goes on exactly.

The table: kill -9 of rank 1's worker while the job writes a checkpoint (every worker held still
first, so that the save is caught unfinished: tests/faults/_runs.py's `held_in_a_save`), at DP=2 and TP=2xPP=2, during an async save, and
with `launcher.max_restarts=1`. What must hold: without restarts, exit 1 and one line on stderr
naming rank 1, its pid and SIGKILL; the tracker at the checkpoint before (the killed save's
staging folder left, unpublished), the directory's lock released; the next run takes the
directory, removes that staging folder and resumes: its checkpoint of the next step is bitwise
the clean run's. With a restart, the job resumes from the checkpoint before, writes the killed
save again, finishes (exit 0, the log of the failure named on stderr), and its last checkpoint is
bitwise the clean run's. No process is left behind.

Then (-m slow): an exception in megatron's save after its files are written, before they are
published (one process); the background writer of an async save cut off after one file; an
exception in one worker's setup, said in one line whose log keeps its traceback.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from torch.distributed.checkpoint.api import CheckpointException

from megatron_ext.checkpointing import tracker, writer_lock
from megatron_ext.checkpointing import torch_dist as ckpt
from megatron_ext.train import run_from_overrides
from tests.faults._job import REPO, TINY, Job
from tests.faults._runs import (
    BASE,
    LAYOUTS,
    SAVES_TWICE,
    assert_bitwise,
    held_in_a_save,
    staging_folders,
    steps_logged,
)

pytestmark = pytest.mark.distributed


@dataclasses.dataclass(frozen=True)
class KillCase:
    layout: str  # a key of LAYOUTS
    settings: tuple[str, ...] = ()  # besides a save at every step
    restarts: int = 0  # launcher.max_restarts


CASES = {
    "a save, DP=2": KillCase("DP=2"),
    "a save, TP=2xPP=2": KillCase("TP=2xPP=2"),
    "an async save, DP=2": KillCase("DP=2", ("checkpoint.async_save=true",)),
    "a save, DP=2, restarted": KillCase("DP=2", restarts=1),
}
DEFAULT = "a save, DP=2"  # the one of the default suite; the others: -m slow
RESTARTED_STEPS = 4  # train.exit_interval of each attempt of a job


@pytest.mark.parametrize(
    "case", [pytest.param(case, id=name, marks=() if name == DEFAULT else pytest.mark.slow) for name, case in CASES.items()]
)
def test_kill_9_of_a_worker_during_a_save_keeps_the_last_checkpoint(case, clean, cache, tmp_path):
    root = tmp_path / "ckpt"
    settings = [*BASE, *LAYOUTS[case.layout].overrides(), cache, f"checkpoint.save={root}", "checkpoint.interval=1",
                *case.settings]
    job = Job([*settings, f"checkpoint.load={root}", f"launcher.max_restarts={case.restarts}",
               f"train.exit_interval={RESTARTED_STEPS}"], TMPDIR=str(tmp_path))
    job.wait_for_step(2)
    with held_in_a_save(job, root) as (previous, workers):
        job.snapshot()  # with the writers of the save: they must not outlive the job either
        workers[1].send_signal(signal.SIGKILL)
    pid = workers[1].pid

    if case.restarts:
        assert job.wait() == 0, job.output[-4000:]
        log = re.fullmatch(r"launcher: the errors of the workers that failed: (\S+)", job.errors[-1])
        # torch's report of the killed worker, kept in the log
        assert log and f"failed (exitcode: -9) local_rank: 1 (pid: {pid})" in Path(log.group(1)).read_text()
        resumed = f"restart 1 of the job after a worker failed: resumed from the checkpoint of iteration {previous}"
        assert resumed in job.output, job.output[-4000:]
        last = previous + RESTARTED_STEPS
    else:
        assert job.wait() == 1, job.output[-4000:]
        assert re.fullmatch(
            rf"error: rank 1 \(pid {pid}\) failed first: killed by SIGKILL; "
            rf"the other ranks' errors \(which follow from it\) are in {re.escape(str(tmp_path))}/\S+\.log",
            job.errors[-1],
        ), job.output[-4000:]
        assert tracker.latest_iteration(root) == previous
        assert staging_folders(root) == [tracker.staging_dir(root, previous + 1).name]
        assert (root / writer_lock.LOCK_FILE).read_text() == ""  # released by the job's launcher
        assert not job.left_behind()
        # the next run of the directory: one step more, from the checkpoint the tracker names
        next_run = Job([*settings, f"checkpoint.load={root}", "train.exit_interval=1"])
        assert next_run.wait() == 0, next_run.output[-4000:]
        assert steps_logged(next_run.output) == [previous + 1], next_run.output[-4000:]
        job, last = next_run, previous + 1
    assert tracker.latest_iteration(root) == last and not staging_folders(root)
    assert not job.left_behind()
    assert_bitwise(root, last, clean(case.layout).root, tmp_path)


# --- saves that die half-way, a worker that fails in its setup (-m slow) ----------------------



class InjectedCrash(RuntimeError):
    pass


@pytest.mark.slow
def test_crash_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch, cache):
    """The crash is injected into megatron's `dist_checkpointing.save` after it has written part of
    the checkpoint, in a one-rank world inside this process; resuming then must continue from the
    previous checkpoint exactly as a run that was never interrupted."""
    root = tmp_path / "ckpt"
    uninterrupted = run_from_overrides([*SAVES_TWICE, cache])["losses"]

    real_save = ckpt.dist_checkpointing.save
    calls = []

    def save_then_crash(state, directory, *args, **kwargs):
        calls.append(directory)
        real_save(state, directory, *args, **kwargs)  # the files are on disk...
        if len(calls) == 2:
            raise InjectedCrash("killed before the checkpoint was published")  # ...unpublished

    monkeypatch.setattr(ckpt.dist_checkpointing, "save", save_then_crash)
    with pytest.raises(InjectedCrash):
        run_from_overrides([*SAVES_TWICE, cache, f"checkpoint.save={root}"])
    monkeypatch.setattr(ckpt.dist_checkpointing, "save", real_save)

    assert ckpt.latest_iteration(root) == 3
    assert not ckpt.iteration_dir(root, 6).exists()
    assert staging_folders(root), "the broken save's staging folder should be left over"

    resumed = run_from_overrides([*SAVES_TWICE, cache, f"checkpoint.load={root}", f"checkpoint.save={root}"])["losses"]
    assert resumed == uninterrupted[3:]
    assert ckpt.latest_iteration(root) == 6
    assert not staging_folders(root), "the next run of the directory cleans up the broken save"


@pytest.mark.slow
def test_async_write_cut_off_keeps_previous_checkpoint(tmp_path, monkeypatch, cache):
    common, root = [*SAVES_TWICE, cache], tmp_path / "ckpt"
    uninterrupted = run_from_overrides(common)["losses"]

    real_write = FileSystemWriterAsync.write_preloaded_data_multiproc

    def write_part_then_die(transform_list, use_msc, rank, write_buckets, results_queue):
        """The background writer of the iteration-6 save: one file, then the process is gone."""
        if ".iter_0000006.tmp" not in str(write_buckets[0][0]):
            return real_write(transform_list, use_msc, rank, write_buckets, results_queue)
        real_write(transform_list, use_msc, rank, write_buckets[:1], queue.Queue())
        os._exit(1)

    monkeypatch.setattr(FileSystemWriterAsync, "write_preloaded_data_multiproc", staticmethod(write_part_then_die))
    with pytest.raises(CheckpointException):  # megatron's finalisation finds the write unfinished
        run_from_overrides([*common, f"checkpoint.save={root}", "checkpoint.async_save=true"])
    monkeypatch.undo()

    assert ckpt.latest_iteration(root) == 3
    assert not ckpt.iteration_dir(root, 6).exists()
    assert list(root.glob(".iter_0000006.tmp/*.distcp")), "the cut-off write should have left part of its files"
    resumed = run_from_overrides([*common, f"checkpoint.load={root}", f"checkpoint.save={root}"])["losses"]
    assert resumed == uninterrupted[3:]
    assert ckpt.latest_iteration(root) == 6


FAULTS = Path(__file__).with_name("_faults.py")


@pytest.mark.slow
@pytest.mark.parametrize("restarts", [0, 1], ids=["ended", "restarted"])
def test_a_worker_failing_in_setup_is_one_line_and_its_log(tmp_path, cache, restarts):
    """A run of 3 workers whose rank 1 raises in its setup (in the job's first attempt only): the
    line names it, or, when the job restarted and finished, the log of its error."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    command = [
        sys.executable, str(FAULTS), "-", *TINY, "launcher.nproc=3", "parallel.dp=3", "train.global_batch_size=3",
        "plugins=[fault]", "fault.kind=raise_in_setup", "fault.rank=1", cache, f"launcher.max_restarts={restarts}",
        "train.iters=2",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr[-4000:]
    if restarts:
        assert done.returncode == 0 and lines[0].startswith("launcher: the errors of the workers that failed: "), lines
        log, pid = Path(lines[0].rsplit(" ", 1)[1]), r"\d+"
    else:
        named = re.fullmatch(
            r"error: rank 1 \(pid (\d+)\) failed first: RuntimeError: injected fault in setup \(exit code 1\); "
            r"its traceback and the other ranks' errors \(which follow from it\) are in (\S+)",
            lines[0],
        )
        assert done.returncode == 1 and named, lines
        log, pid = Path(named.group(2)), named.group(1)
    assert log.parent == tmp_path
    text = log.read_text()  # the failed rank's own traceback, and torch's report of a failed worker
    assert re.search(rf"^rank 1 \(pid {pid}, attempt 0\) failed:\nTraceback", text, re.M), text
    assert "RuntimeError: injected fault in setup" in text and "failed (exitcode: " in text, text
