"""Pre-emption as SLURM, torchrun and a terminal deliver it, to a job of 4 local workers
(`python -m megatron_ext.train` in its own process group): whichever of its processes gets the
signal, the job saves a complete checkpoint (a resume from it works) and exits 0, leaving no
process behind; a second signal aborts and leaves the previous checkpoint the latest; a worker
that fails while the job stops ends the run, with no restart. Also: a killed worker is named,
and a local job listens on 127.0.0.1 only."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

from megatron_ext.platform.signals import SAME_REQUEST_S
from megatron_ext.checkpointing import torch_dist as ckpt
from tests.distributed._job import TINY, Job, run_job

pytestmark = pytest.mark.distributed

DP4 = ["launcher.nproc=4", "parallel.dp=4"]
# The default experiment's kind of job: a reshard worker pool at TP2 x PP2.
POOL = ["launcher.nproc=4", "parallel.tp=2", "parallel.pp=2", "plugins=[reshard]"]
# A pool whose layout uses 2 of its 3 workers: the last one waits on standby, in no world.
POOL_WITH_STANDBY = ["launcher.nproc=3", "parallel.tp=2", "parallel.dp=1", "plugins=[reshard]"]

# name: (job, the process signalled, the signal, when: while training, or as soon as the
# workers exist: while they import and build their model)
CASES = {
    "scancel: SIGTERM to the group": (DP4, "group", signal.SIGTERM, "training"),
}
SLOW_CASES = {
    "SIGUSR1 to one worker in its setup": (DP4, "worker", signal.SIGUSR1, "setup"),
    "SIGTERM to a pool's standby worker": (POOL_WITH_STANDBY, "last worker", signal.SIGTERM, "training"),
    "SIGTERM to the forkserver alone": (DP4, "forkserver", signal.SIGTERM, "training"),
    "SIGUSR1 to the launcher": (DP4, "launcher", signal.SIGUSR1, "training"),
    "scancel to a worker pool": (POOL, "group", signal.SIGTERM, "training"),
    "Ctrl-C: SIGINT to the group": (DP4, "group", signal.SIGINT, "training"),
    "SIGINT to one worker": (DP4, "worker", signal.SIGINT, "training"),
    "SIGTERM to the launcher": (DP4, "launcher", signal.SIGTERM, "training"),
    "SIGINT to the launcher": (DP4, "launcher", signal.SIGINT, "training"),
    "SIGTERM to one worker in its setup": (DP4, "worker", signal.SIGTERM, "setup"),
    "SIGUSR1 to a worker pool's launcher": (POOL, "launcher", signal.SIGUSR1, "training"),
    "SIGINT to a pool's standby worker": (POOL_WITH_STANDBY, "last worker", signal.SIGINT, "training"),
    "SIGUSR1 to a pool's standby worker": (POOL_WITH_STANDBY, "last worker", signal.SIGUSR1, "training"),
}


def _params(cases: dict, *marks) -> list:
    return [pytest.param(*case, id=name, marks=marks) for name, case in cases.items()]


@pytest.fixture
def dirs(tmp_path) -> tuple[Path, list[str]]:
    root = tmp_path / "ckpt"
    return root, [f"checkpoint.save={root}", f"data.cache_dir={tmp_path / 'cache'}"]


@pytest.mark.parametrize("layout, target, signum, when", _params(CASES) + _params(SLOW_CASES, pytest.mark.slow))
def test_signal_saves_and_exits_0(dirs, layout, target, signum, when):
    root, paths = dirs
    job = Job([*TINY, *layout, *paths])
    if when == "setup":
        job.wait_for_workers(4)
    else:
        job.wait_for_step(3)
    job.signal(target, signum)
    assert job.wait() == 0, job.output[-4000:]
    stopped_at = ckpt.latest_iteration(root)
    assert stopped_at is not None and stopped_at >= (1 if when == "setup" else 3), job.output[-4000:]
    assert not job.left_behind()
    _assert_resumes(root, paths, stopped_at)


# name: the layout of a job that saves every step (its checkpoint writers' helper process is up)
DURING_SAVES = {"DP=2": (["launcher.nproc=2", "parallel.dp=2"],)}
SLOW_DURING_SAVES = {"TP=2 x PP=2": (["launcher.nproc=4", "parallel.tp=2", "parallel.pp=2"],)}


@pytest.mark.parametrize("layout", _params(DURING_SAVES) + _params(SLOW_DURING_SAVES, pytest.mark.slow))
def test_a_group_signal_during_a_save_lets_it_finish_and_exits_0(dirs, layout):
    """scancel while a save is written: the writers outlive the signal, the save completes, the
    stop checkpoint follows, no staging folder is left."""
    root, paths = dirs
    job = Job([*TINY, *layout, *paths, "checkpoint.interval=1"])
    job.wait_for_step(2)
    job.wait_until(lambda: any(root.glob(".iter_*.tmp")), "a save", poll_s=0.001)
    job.signal("group", signal.SIGTERM)
    assert job.wait() == 0, job.output[-4000:]
    assert not list(root.glob(".iter_*")) and not job.left_behind()
    stopped_at = ckpt.latest_iteration(root)
    assert stopped_at is not None and stopped_at >= 2, job.output[-4000:]
    _assert_resumes(root, paths, stopped_at)


# name: (extra settings, whether a second signal is sent, what the launcher says)
ABORTS = {"a second signal": ([], True, "aborted (a second SIGTERM)")}
SLOW_ABORTS = {  # the same path, reached by a timer
    "the deadline": (["launcher.preempt_timeout_s=10"], False, "aborted (no exit 10 s after SIGTERM)"),
}


@pytest.mark.parametrize("settings, second_signal, said", _params(ABORTS) + _params(SLOW_ABORTS, pytest.mark.slow))
def test_abort_during_the_save_keeps_the_previous_checkpoint(dirs, settings, second_signal, said):
    root, paths = dirs
    job = Job([*TINY, *DP4, *paths, "checkpoint.interval=2", *settings])
    job.wait_until(lambda: ckpt.latest_iteration(root) == 2 and job.last_step() >= 3, "the checkpoint of step 2")
    job.wait_for_step(3)
    first = time.monotonic()
    job.signal("group", signal.SIGTERM)
    job.wait_until(lambda: any(root.glob(".iter_*.tmp")), "the save after the signal", poll_s=0.002)
    job.workers[0].suspend()  # holds the save where it is: every rank waits for this one
    time.sleep(0.5)
    previous = ckpt.latest_iteration(root)
    assert any(root.glob(".iter_*.tmp")), "the save finished before it could be interrupted"
    if second_signal:
        time.sleep(max(0.0, first + SAME_REQUEST_S + 0.2 - time.monotonic()))
        job.signal("group", signal.SIGTERM)
    assert job.wait() == 128 + signal.SIGTERM, job.output[-4000:]
    assert said in job.output
    assert ckpt.latest_iteration(root) == previous
    assert not job.left_behind()
    _assert_resumes(root, paths, previous)


FAULTS = Path(__file__).with_name("_faults.py")
# What torch's elastic agent logs (at LOGLEVEL=INFO) each time it starts the workers.
WORKERS_START = "Starting worker group"


@pytest.mark.slow  # 30 s: the restart path of a stop, beside the default suite's stops
def test_a_worker_failing_during_the_stop_is_not_restarted(dirs):
    root, paths = dirs
    rc, output = run_job([*TINY, *DP4, *paths, "train.iters=2"])  # the last complete checkpoint
    assert rc == 0 and ckpt.latest_iteration(root) == 2, output[-4000:]
    fault = ["plugins=[fault]", "fault.kind=raise_in_stop_save", "fault.rank=1"]
    settings = [*TINY, *DP4, *paths, *fault, f"checkpoint.load={root}", "launcher.max_restarts=2"]
    job = Job(settings, entry=[str(FAULTS), "-"], LOGLEVEL="INFO")
    job.wait_for_step(3)
    job.signal("worker", signal.SIGTERM)  # rank 1 alone: the launcher learns of it from the worker
    job.wait_until(lambda: job.process.poll() is not None or job.output.count(WORKERS_START) > 1, "the end or a restart")
    starts = job.output.count(WORKERS_START)
    if starts > 1:
        job.kill()
    assert starts == 1, "the workers were restarted after the stop request"
    assert job.wait() == 1, job.output[-4000:]
    assert "fault: raising in the save of the stop" in job.output
    assert re.search(r"^error: rank 1 \(pid \d+\) failed first: RuntimeError: injected fault in the save of the stop \(exit code 1\); .*; not restarted: the job was asked to stop$", job.output, re.M), job.output[-4000:]
    assert not job.left_behind()
    assert ckpt.latest_iteration(root) == 2
    _assert_resumes(root, paths, 2)


def test_killed_worker_is_named(dirs):
    _, paths = dirs
    job = Job([*TINY, *DP4, *paths])
    job.wait_for_step(2)
    pid = job.signal("worker", signal.SIGKILL)
    assert job.wait() == 1
    named = re.findall(r"error: rank (\d) \(pid (\d+)\) failed first: (.*?);", job.output)
    assert [(int(p), why) for _, p, why in named] == [(pid, "killed by SIGKILL")], job.output[-4000:]
    assert not job.left_behind()


def test_local_job_listens_on_localhost_only(dirs):
    _, paths = dirs
    job = Job([*TINY, *DP4, *paths])
    job.wait_for_step(2)
    listening = {
        (p.pid, c.laddr.ip)
        for p in job.processes()
        for c in p.net_connections(kind="inet")
        if c.status == "LISTEN"
    }
    job.signal("group", signal.SIGTERM)
    assert job.wait() == 0, job.output[-4000:]
    # the rendezvous store on the launcher; the workers' store and gloo's ports on the workers
    assert {pid for pid, _ in listening} == {job.process.pid, *(w.pid for w in job.workers_at_start)}
    assert {ip for _, ip in listening} == {"127.0.0.1"}, listening


def _assert_resumes(root: Path, paths: list[str], iteration: int) -> None:
    """A one-process run from checkpoint `iteration` trains the step after it."""
    rc, output = run_job([*TINY, "launcher.nproc=1", *paths, f"checkpoint.load={root}", f"train.iters={iteration + 1}"])
    steps = re.findall(r"^iter\s+(\d+)/", output, re.M)
    assert rc == 0 and steps == [str(iteration + 1)], output[-4000:]
