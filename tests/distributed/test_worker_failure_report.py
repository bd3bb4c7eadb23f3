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


def test_a_worker_failing_in_setup_is_one_line_and_its_log(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    command = [
        sys.executable, str(FAULTS), "-", *TINY, "launcher.nproc=3", "parallel.dp=3", "train.global_batch_size=3",
        "plugins=[fault]", "fault.kind=raise_in_setup", "fault.rank=1", f"data.cache_dir={tmp_path / 'cache'}",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
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
    text = log.read_text()
    # the failed rank's own traceback, and torch's report of a failed worker
    assert re.search(rf"^rank 1 \(pid {named.group(1)}, attempt 0\) failed:\nTraceback", text, re.M), text
    assert "RuntimeError: injected fault in setup" in text and "failed (exitcode: " in text, text
