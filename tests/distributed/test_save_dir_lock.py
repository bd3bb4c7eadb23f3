"""One writer per checkpoint directory, with real runs of local workers: a run takes over the lock
a dead run left (a notice, the dead run's broken save removed); a second run given its
directory while it trains (its workers paused meanwhile, so that it cannot end first) is refused
in under 10 s with one line naming the first run's launcher; the first run finishes unharmed,
and a resume from its checkpoint continues it bitwise."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_ext.checkpointing import tracker, writer_lock
from tests.distributed._job import Job

# 25 s of two live runs; the default suite refuses a second run in tests/unit/test_writer_lock.py
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
# A run through train.run, its summary (the losses of every step) written to argv[1].
SUMMARY = "import json, sys; from megatron_ext.train import run_from_overrides; json.dump(run_from_overrides(sys.argv[2:]), open(sys.argv[1], 'w'))"
ITERS, INTERVAL = 6, 3
RUN = [
    "experiment=none",
    "launcher.nproc=2",
    "parallel.dp=2",
    f"train.iters={ITERS}",
    "train.eval_interval=0",
    "logging.progress_bar=false",
    "logging.log_interval=1",
    "model.seq_length=32",
    "train.micro_batch_size=1",
    "train.global_batch_size=2",
    f"checkpoint.interval={INTERVAL}",
]


def _summary_run(summary: Path, *overrides: str) -> Job:
    return Job([*RUN, *overrides], entry=("-c", SUMMARY, str(summary)))


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    return int(done.stdout)


def test_a_second_run_is_refused_and_the_first_resumes_bitwise(tmp_path):
    root, cache = tmp_path / "ckpt", tmp_path / "cache"
    root.mkdir()
    dead = _dead_pid()
    (root / writer_lock.LOCK_FILE).write_text(json.dumps({"host": "gone", "pid": dead, "since": "2025-01-01 00:00:00"}))
    tracker.staging_dir(root, 7).mkdir()  # the dead run's broken save

    first = _summary_run(tmp_path / "first.json", f"checkpoint.save={root}", f"data.cache_dir={cache}")
    first.wait_for_step(1)
    for worker in first.workers_at_start:
        worker.suspend()
    holder = json.loads((root / writer_lock.LOCK_FILE).read_text())
    assert (holder["pid"], holder["host"]) == (first.process.pid, socket.gethostname())
    assert not tracker.staging_dir(root, 7).exists()

    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE" and not k.startswith("SLURM_")}
    start = time.monotonic()
    second = subprocess.run(
        [sys.executable, "-m", "megatron_ext.train", *RUN, f"checkpoint.save={root}", f"data.cache_dir={cache}"],
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
        f"checkpoint.save={tmp_path / 'resumed'}", f"data.cache_dir={cache}",
    )
    assert resumed.wait() == 0, resumed.output[-4000:]
    assert json.loads((tmp_path / "resumed.json").read_text())["losses"] == losses[INTERVAL:]  # exact: bitwise
    assert not re.search(r"\.iter_\d+\.tmp", " ".join(p.name for p in root.iterdir()))
