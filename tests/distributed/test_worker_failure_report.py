"""A worker that fails is one line on the terminal: its rank, pid and error, and the log file
that keeps what would otherwise surround it there (its traceback, torch's report of the failure,
the other ranks' errors and notices as they are ended)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed._job import TINY

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
FAULTS = REPO / "tests" / "distributed" / "_faults.py"


def _failing_in_setup(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    """A run of 3 workers whose rank 1 raises in its setup (in the job's first attempt only), its
    log file in `tmp_path`."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    command = [
        sys.executable, str(FAULTS), "-", *TINY, "launcher.nproc=3", "parallel.dp=3", "train.global_batch_size=3",
        "plugins=[fault]", "fault.kind=raise_in_setup", "fault.rank=1", f"data.cache_dir={tmp_path / 'cache'}", *overrides,
    ]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def _assert_holds_the_failure(log: Path, pid: str) -> None:
    """The failed rank's own traceback, and torch's report of a failed worker."""
    text = log.read_text()
    assert re.search(rf"^rank 1 \(pid {pid}, attempt 0\) failed:\nTraceback", text, re.M), text
    assert "RuntimeError: injected fault in setup" in text and "failed (exitcode: " in text, text


def test_a_worker_failing_in_setup_is_one_line_and_its_log(tmp_path):
    done = _failing_in_setup(tmp_path)
    assert done.returncode == 1, done.stderr[-4000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr[-4000:]
    named = re.fullmatch(
        r"error: rank 1 \(pid (\d+)\) failed first: RuntimeError: injected fault in setup \(exit code 1\); "
        r"its traceback and the other ranks' errors \(which follow from it\) are in (\S+)",
        lines[0],
    )
    assert named, lines[0]
    log = Path(named.group(2))
    assert log.parent == tmp_path
    _assert_holds_the_failure(log, named.group(1))


@pytest.mark.slow  # the job runs twice
def test_a_restarted_failure_is_named_by_its_log(tmp_path):
    done = _failing_in_setup(tmp_path, "launcher.max_restarts=1", "train.iters=2")
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("launcher: the errors of the workers that failed: "), done.stderr[-4000:]
    log = Path(lines[0].rsplit(" ", 1)[1])
    assert log.parent == tmp_path
    _assert_holds_the_failure(log, r"\d+")
