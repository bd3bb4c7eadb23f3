"""Pre-emption signals (SIGTERM, SIGINT, SIGUSR1) as SLURM, torchrun and a terminal deliver them.

The table: each signal to the job's process group (`scancel`, Ctrl-C, SLURM's warning) while it
writes a checkpoint, while its background writer writes an async one, and while the reshard
plugin moves its state to another layout (sent from inside the move: tests/faults/_faults.py's
`fault.kind=signal`), at DP=2 and TP=2xPP=2. What must hold: the save or the move under way
completes, the ranks stop after the step they are in with a checkpoint of it, and the job exits
0, saying on stderr the launcher's line and one notice per worker, nothing else; the tracker
names that checkpoint, no staging folder and no process is left, and the checkpoint is bitwise
the clean run's of the same iteration.

Then, in a job of 4 local workers (-m slow): whichever of its processes gets a signal, while it
trains or sets up, the job saves, exits 0 and resumes; a second signal, or the deadline, aborts
and leaves the previous checkpoint the latest; a worker that fails while the job stops ends the
run, with no restart.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import time
from pathlib import Path

import pytest

from megatron_ext.checkpointing import tracker
from megatron_ext.platform import signals
from megatron_ext.platform.local_workers import LocalWorkers
from megatron_ext.platform.signals import SAME_REQUEST_S, SignalCount
from tests.faults._job import TINY, Job, run_job
from tests.faults._runs import (
    BASE,
    FAULT_PLUGINS,
    LAYOUTS,
    RESHARD_STEP,
    assert_bitwise,
    held_in_a_save,
    staging_folders,
    steps_logged,
)

pytestmark = pytest.mark.distributed


@dataclasses.dataclass(frozen=True)
class SignalCase:
    signum: signal.Signals  # sent to the job's process group
    during: str  # a save | an async save | a reshard move
    layout: str  # a key of LAYOUTS


CASES = {
    f"{signum.name} during {during}, {layout}": SignalCase(signum, during, layout)
    for signum, during, layout in [
        (signal.SIGTERM, "a save", "DP=2"),
        (signal.SIGINT, "a save", "TP=2xPP=2"),
        (signal.SIGUSR1, "a save", "DP=2"),
        (signal.SIGTERM, "an async save", "TP=2xPP=2"),
        (signal.SIGINT, "an async save", "DP=2"),
        (signal.SIGUSR1, "an async save", "TP=2xPP=2"),
        (signal.SIGTERM, "a reshard move", "reshard mid-move"),
        (signal.SIGINT, "a reshard move", "reshard mid-move"),
        (signal.SIGUSR1, "a reshard move", "reshard mid-move"),
    ]
}
DEFAULT = "SIGTERM during a save, DP=2"  # the one of the default suite; the others: -m slow
WORKERS = {"DP=2": 2, "TP=2xPP=2": 4, "reshard mid-move": 4}
# What a worker says when the request reaches it: the signal itself, or the launcher's forward.
NOTICE = re.compile(r"\[pid \d+\] (SIG\w+|a request from the launcher): saving a checkpoint at the next step boundary, then stopping")


def _params(cases: dict, *marks) -> list:
    return [pytest.param(*case, id=name, marks=marks) for name, case in cases.items()]


@pytest.mark.parametrize(
    "case", [pytest.param(case, id=name, marks=() if name == DEFAULT else pytest.mark.slow) for name, case in CASES.items()]
)
def test_a_signal_during_a_save_or_a_move_stops_with_the_clean_runs_state(case, clean, cache, tmp_path):
    root = tmp_path / "ckpt"
    settings = [*BASE, cache, f"checkpoint.save={root}"]
    if case.during == "a reshard move":
        fault = ["fault.kind=signal", f"fault.signal={case.signum.name}", "fault.rank=1"]
        job = Job([*settings, *LAYOUTS[case.layout].overrides("fault"), *fault], **FAULT_PLUGINS)
    else:
        async_save = str(case.during == "an async save").lower()
        job = Job([*settings, *LAYOUTS[case.layout].overrides(), "checkpoint.interval=1", f"checkpoint.async_save={async_save}"])
        job.wait_for_step(2)
        with held_in_a_save(job, root):  # the workers meet the signal mid-save; their writers at once
            job.signal("group", case.signum)
    assert job.wait() == 0, job.output[-4000:]
    stopped = re.findall(r"^signal received: stopping after iteration (\d+)$", "".join(job.lines), re.M)
    assert len(stopped) == 1 and steps_logged(job.output)[-1] == int(stopped[0]), job.output[-4000:]
    stopped_at = int(stopped[0])
    if case.during == "a reshard move":
        assert stopped_at == RESHARD_STEP and "reshard tp2·pp2·dp1 -> tp1·pp2·dp2" in job.output, job.output[-4000:]
    launcher = f"launcher: {case.signum.name}: forwarded to the workers, waiting for their checkpoint"
    notices = [line for line in job.errors if NOTICE.fullmatch(line)]
    assert len(notices) == WORKERS[case.layout] and sorted([launcher, *notices]) == sorted(job.errors), job.errors
    assert tracker.latest_iteration(root) == stopped_at and not staging_folders(root)
    assert not job.left_behind()
    assert_bitwise(root, stopped_at, clean(case.layout).root, tmp_path)


def test_one_request_by_two_paths_at_once_is_noted_once(monkeypatch):
    """The group's SIGTERM and the launcher's forward of it, the forward arriving while the
    handler of the signal runs (here: at its call of signal_name): one notice, of the first."""
    name = signals.signal_name

    def forwarded_meanwhile(signum: int) -> str:
        os.kill(os.getpid(), signals.FORWARDED_REQUEST)
        return name(signum)

    monkeypatch.setattr(signals, "signal_name", forwarded_meanwhile)
    said: list[str] = []
    with signals.preemption_signals(from_launcher=True, notices=said.append) as noted:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0)  # a call: where the handlers run
    assert noted.signum == signal.SIGTERM
    assert said == [f"[pid {os.getpid()}] SIGTERM: saving a checkpoint at the next step boundary, then stopping"]


def test_the_launcher_forwards_one_request_that_comes_by_two_paths_at_once(monkeypatch, capfd):
    """The group's SIGTERM and the forkserver's pass of it to the launcher, the second arriving
    while the launcher's handler of the first runs (here: as it counts it): one line."""
    count, sent = SignalCount.is_second_request, []

    def passed_on_meanwhile(self, signum: int) -> bool:
        if not sent:
            sent.append(signum)
            os.kill(os.getpid(), signum)
        return count(self, signum)

    monkeypatch.setattr(SignalCount, "is_second_request", passed_on_meanwhile)
    with LocalWorkers(preemption=True, deadline_s=None):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0)  # a call: where the handlers run
    assert capfd.readouterr().err.splitlines() == ["launcher: SIGTERM: forwarded to the workers, waiting for their checkpoint"]


# --- one process of a 4-worker job signalled; a second signal; a failure during the stop (-m slow) ---

DP4 = ["launcher.nproc=4", "parallel.dp=4"]
# The default experiment's kind of job: a reshard worker pool at TP2 x PP2.
POOL = ["launcher.nproc=4", "parallel.tp=2", "parallel.pp=2", "plugins=[reshard]"]
# A pool whose layout uses 2 of its 3 workers: the last one waits on standby, in no world.
POOL_WITH_STANDBY = ["launcher.nproc=3", "parallel.tp=2", "parallel.dp=1", "plugins=[reshard]"]

# name: (job, the process signalled, the signal, when: while training, or as soon as the
# workers exist: while they import and build their model)
ONE_PROCESS_CASES = {
    "scancel: SIGTERM to the group": (DP4, "group", signal.SIGTERM, "training"),
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
    "SIGUSR1 to a run of one process": (["launcher.nproc=1"], "launcher", signal.SIGUSR1, "training"),
}


@pytest.fixture
def dirs(tmp_path, cache) -> tuple[Path, list[str]]:
    root = tmp_path / "ckpt"
    return root, [f"checkpoint.save={root}", cache]


@pytest.mark.slow
@pytest.mark.parametrize("layout, target, signum, when", _params(ONE_PROCESS_CASES))
def test_signal_saves_and_exits_0(dirs, layout, target, signum, when):
    root, paths = dirs
    job = Job([*TINY, *layout, *paths])
    if when == "setup":
        job.wait_for_workers(4)
    else:
        job.wait_for_step(3)
    job.signal(target, signum)
    assert job.wait() == 0, job.output[-4000:]
    stopped_at = tracker.latest_iteration(root)
    assert stopped_at is not None and stopped_at >= (1 if when == "setup" else 3), job.output[-4000:]
    assert not job.left_behind()
    _assert_resumes(root, paths, stopped_at)


# name: (extra settings, whether a second signal is sent, what the launcher says)
ABORTS = {
    "a second signal": ([], True, "aborted (a second SIGTERM)"),
    "the deadline": (["launcher.preempt_timeout_s=10"], False, "aborted (no exit 10 s after SIGTERM)"),
}


@pytest.mark.slow
@pytest.mark.parametrize("settings, second_signal, said", _params(ABORTS))
def test_abort_during_the_save_keeps_the_previous_checkpoint(dirs, settings, second_signal, said):
    root, paths = dirs
    job = Job([*TINY, *DP4, *paths, "checkpoint.interval=2", *settings])
    job.wait_until(lambda: tracker.latest_iteration(root) == 2 and job.last_step() >= 3, "the checkpoint of step 2")
    job.wait_for_step(3)
    first = time.monotonic()
    job.signal("group", signal.SIGTERM)
    job.wait_until(lambda: staging_folders(root), "the save after the signal", poll_s=0.002)
    job.workers[0].suspend()  # holds the save where it is: every rank waits for this one
    time.sleep(0.5)
    previous = tracker.latest_iteration(root)
    assert staging_folders(root), "the save finished before it could be interrupted"
    if second_signal:
        time.sleep(max(0.0, first + SAME_REQUEST_S + 0.2 - time.monotonic()))
        job.signal("group", signal.SIGTERM)
    assert job.wait() == 128 + signal.SIGTERM, job.output[-4000:]
    assert said in job.output
    assert tracker.latest_iteration(root) == previous
    assert not job.left_behind()
    _assert_resumes(root, paths, previous)


FAULTS = Path(__file__).with_name("_faults.py")
# What torch's elastic agent logs (at LOGLEVEL=INFO) each time it starts the workers.
WORKERS_START = "Starting worker group"


@pytest.mark.slow  # 30 s: the restart path of a stop, beside the default suite's stop
def test_a_worker_failing_during_the_stop_is_not_restarted(dirs):
    root, paths = dirs
    rc, output = run_job([*TINY, *DP4, *paths, "train.iters=2"])  # the last complete checkpoint
    assert rc == 0 and tracker.latest_iteration(root) == 2, output[-4000:]
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
    assert tracker.latest_iteration(root) == 2
    _assert_resumes(root, paths, 2)


def _assert_resumes(root: Path, paths: list[str], iteration: int) -> None:
    """A one-process run from checkpoint `iteration` trains the step after it."""
    rc, output = run_job([*TINY, "launcher.nproc=1", *paths, f"checkpoint.load={root}", f"train.iters={iteration + 1}"])
    assert rc == 0 and steps_logged(output) == [iteration + 1], output[-4000:]
