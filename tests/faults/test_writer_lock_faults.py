"""Two runs on one checkpoint directory, and a stale lock (checkpointing/writer_lock.py).

A run holding the directory's lock in another process refuses a second one: exit 2 and one line
naming the holder's pid and host, within seconds, nothing written; the lock dies with its
process and the next run takes it over with a notice naming the one that left it; only the taker
removes leftover staging folders, and a run that ends leaves the record empty.

Then (-m slow) the same with real runs of local workers: a run takes over the lock a dead run
left (a notice, the dead run's broken save removed); a second run given its directory while it
trains (its workers paused meanwhile, so that it cannot end first) is refused in under 10 s with
one line naming the first run's launcher; the first run finishes unharmed, and a resume from its
checkpoint continues it bitwise.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_ext.checkpointing import tracker, writer_lock
from megatron_ext.config import CheckpointConfig, Config
from megatron_ext.config.validate import ConfigError
from megatron_ext.train import holding_the_save_dir, main
from tests.faults._job import Job
from tests.faults._runs import BASE

REPO = Path(__file__).resolve().parents[2]
HOLD = "import sys, time; from megatron_ext.checkpointing.writer_lock import take; take(sys.argv[1]); print('held', flush=True); time.sleep(300)"


@pytest.fixture
def holder(tmp_path):
    """Another process holding `tmp_path / "run"`'s writer lock (killed at the end)."""
    root = tmp_path / "run"
    root.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(root)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stdout.readline() == "held\n"
        yield root, process
    finally:
        process.kill()
        process.wait()


def _refusal(root: Path, pid: int) -> str:
    return f"checkpoint.save: {root} is in use by pid {pid} on host {socket.gethostname()} (since "


def test_a_held_directory_is_refused_naming_the_holder(holder):
    root, process = holder
    for attempt in (writer_lock.check_free, writer_lock.take):
        with pytest.raises(ConfigError) as refused:
            attempt(root)
        assert str(refused.value).startswith(_refusal(root, process.pid)), refused.value
        assert "\n" not in str(refused.value)


def test_a_run_on_a_held_directory_is_one_line_exit_2(holder, tmp_path, monkeypatch, capsys):
    root, process = holder
    monkeypatch.chdir(tmp_path)
    start = time.monotonic()
    with pytest.raises(SystemExit) as exit_:
        main(["experiment=none", "launcher.nproc=1", "launcher.device=cpu", f"checkpoint.save={root}"])
    took = time.monotonic() - start
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith(f"error: {_refusal(root, process.pid)}"), err
    assert took < 10, took
    assert [p.name for p in root.iterdir()] == [writer_lock.LOCK_FILE]


def test_the_lock_dies_with_its_holder_and_is_taken_over(holder):
    root, process = holder
    process.send_signal(signal.SIGKILL)
    process.wait()
    writer_lock.check_free(root)
    lock = writer_lock.take(root)
    try:
        assert lock.previous is not None and (lock.previous.pid, lock.previous.host) == (process.pid, socket.gethostname())
        assert json.loads((root / writer_lock.LOCK_FILE).read_text())["pid"] == os.getpid()
    finally:
        lock.release()
    assert (root / writer_lock.LOCK_FILE).read_text() == ""  # released: the next run has nothing to take over
    again = writer_lock.take(root)
    again.release()
    assert again.previous is None


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    return int(done.stdout)


def test_a_stale_lock_file_is_taken_over_with_a_notice_and_leftovers_go(tmp_path, capsys):
    root = tmp_path / "run"
    tracker.iteration_dir(root, 2).mkdir(parents=True)
    (root / tracker.TRACKER).write_text("2\n")
    tracker.staging_dir(root, 4).mkdir()  # a save the dead run never finished
    (tracker.staging_dir(root, 4) / "__0_0.distcp").write_bytes(b"x")
    dead = writer_lock.Holder("elsewhere", _dead_pid(), "2025-01-02 03:04:05")
    (root / writer_lock.LOCK_FILE).write_text(json.dumps({"host": dead.host, "pid": dead.pid, "since": dead.since}))

    with holding_the_save_dir(Config(checkpoint=CheckpointConfig(save=str(root)))):
        assert capsys.readouterr().err.splitlines() == [
            f"notice: checkpoint.save: took over {root} from pid {dead.pid} on host elsewhere (since 2025-01-02 03:04:05), "
            "which ended without releasing it"
        ]
        assert sorted(p.name for p in root.iterdir()) == [writer_lock.LOCK_FILE, "iter_0000002", tracker.TRACKER]
        held = json.loads((root / writer_lock.LOCK_FILE).read_text())
        assert (held["pid"], held["host"]) == (os.getpid(), socket.gethostname())
        with pytest.raises(ConfigError, match=f"is in use by pid {os.getpid()} "):
            writer_lock.check_free(root)  # another open of the file: as another run sees it
    assert (root / writer_lock.LOCK_FILE).read_text() == ""
    writer_lock.check_free(root)


def test_a_save_replaces_only_its_own_staging(tmp_path, one_rank_world):
    # Another run's save in progress (a directory nobody locked) is not a save's to remove.
    from megatron_ext.checkpointing import torch_dist as ckpt  # torch and megatron: only this test saves

    other = tracker.staging_dir(tmp_path, 9)
    other.mkdir()
    tracker.staging_dir(tmp_path, 3).mkdir()  # this iteration's, left by an earlier attempt
    ckpt.write_staged(tmp_path, 3, lambda folder: (folder / "shard").write_text("3"))
    assert (tracker.iteration_dir(tmp_path, 3) / "shard").read_text() == "3"
    assert other.is_dir() and not tracker.staging_dir(tmp_path, 3).exists()


# --- two live runs (-m slow) ---------------------------------------------------------------------

# A run through train.run, its summary (the losses of every step) written to argv[1].
SUMMARY = "import json, sys; from megatron_ext.train import run_from_overrides; json.dump(run_from_overrides(sys.argv[2:]), open(sys.argv[1], 'w'))"
ITERS, INTERVAL = 6, 3
RUN = [
    *(o for o in BASE if not o.startswith("train.iters=")),
    "launcher.nproc=2",
    "parallel.dp=2",
    f"train.iters={ITERS}",
    f"checkpoint.interval={INTERVAL}",
]


def _summary_run(summary: Path, *overrides: str) -> Job:
    return Job([*RUN, *overrides], entry=("-c", SUMMARY, str(summary)))


@pytest.mark.slow  # 25 s of two live runs, beside the one-process refusal above
@pytest.mark.distributed
def test_a_second_run_is_refused_and_the_first_resumes_bitwise(tmp_path, cache):
    root = tmp_path / "ckpt"
    root.mkdir()
    dead = _dead_pid()
    (root / writer_lock.LOCK_FILE).write_text(json.dumps({"host": "gone", "pid": dead, "since": "2025-01-01 00:00:00"}))
    tracker.staging_dir(root, 7).mkdir()  # the dead run's broken save

    first = _summary_run(tmp_path / "first.json", f"checkpoint.save={root}", cache)
    first.wait_for_step(1)
    for worker in first.workers_at_start:
        worker.suspend()
    holder = json.loads((root / writer_lock.LOCK_FILE).read_text())
    assert (holder["pid"], holder["host"]) == (first.process.pid, socket.gethostname())
    assert not tracker.staging_dir(root, 7).exists()

    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE" and not k.startswith("SLURM_")}
    start = time.monotonic()
    second = subprocess.run(
        [sys.executable, "-m", "megatron_ext.train", *RUN, f"checkpoint.save={root}", cache],
        env=dict(env, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"), cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    took = time.monotonic() - start
    for worker in first.workers_at_start:
        worker.resume()
    assert second.returncode == 2, second.stderr[-3000:]
    assert second.stderr.strip().splitlines() == [
        f"error: checkpoint.save: {root} is in use by pid {first.process.pid} on host {socket.gethostname()} (since {holder['since']})"
    ]
    assert took < 10, took

    assert first.wait() == 0, first.output[-4000:]
    assert f"notice: checkpoint.save: took over {root} from pid {dead} on host gone (since 2025-01-01 00:00:00), which ended without releasing it" in first.output
    assert "Traceback" not in first.output, first.output[-4000:]
    assert tracker.latest_iteration(root) == ITERS and (root / writer_lock.LOCK_FILE).read_text() == ""
    losses = json.loads((tmp_path / "first.json").read_text())["losses"]

    resumed = _summary_run(
        tmp_path / "resumed.json", f"checkpoint.load={root}", f"checkpoint.step={INTERVAL}",
        f"checkpoint.save={tmp_path / 'resumed'}", cache,
    )
    assert resumed.wait() == 0, resumed.output[-4000:]
    assert json.loads((tmp_path / "resumed.json").read_text())["losses"] == losses[INTERVAL:]  # exact: bitwise
    assert not re.search(r"\.iter_\d+\.tmp", " ".join(p.name for p in root.iterdir()))
