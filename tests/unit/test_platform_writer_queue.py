"""Megatron's checkpoint writer serves its results queue from a manager process; a worker that
dies abruptly must not leave that process behind (it would hold the job's output open, and a
launcher waiting for it would wait for ever)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A worker: takes megatron's results queue as a save does, says who serves it, dies on the spot.
WORKER = """
import os
from megatron_ext.platform import writer_queue
writer_queue.apply()
from megatron.core.dist_checkpointing.strategies import filesystem_async
queue = filesystem_async._get_write_results_queue()
queue.put("written")
assert queue.get() == "written"
print(writer_queue._manager._process.pid, flush=True)
os._exit(1)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in state  # a zombie has ended


def test_the_writer_queue_process_ends_with_its_worker():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    manager = int(done.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while alive(manager) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(manager), f"megatron's writer queue process {manager} outlived its worker"
