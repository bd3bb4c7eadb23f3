"""The helper process of megatron's checkpoint writer goes when its worker goes, and only then.

megatron-core's dist_checkpointing (torch_dist format) collects a rank's write results through a
queue served by a `multiprocessing` manager process, which it starts at the rank's first save and
never stops. A worker that dies abruptly (killed, `os._exit`, the OOM killer) leaves that process
running for ever, and it holds the worker's stdout and stderr: whoever waits for the end of the
job's output (a launcher, a test's `subprocess.run`) then waits for ever too. Here the manager
is started with a watchdog that ends it once its worker is gone. It ignores the pre-emption
signals: a signal to the job's process group (`scancel`, Ctrl-C) reaches it too, and killed it
would take the save under way with it (the writers' results could not be sent: BrokenPipeError);
the worker decides when to stop, after that save. Everything else is megatron's.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from multiprocessing.managers import SyncManager
from typing import Optional

from megatron_ext.platform.signals import FORWARDED_REQUEST, PREEMPTION_SIGNALS

# How often the manager looks for its worker, in seconds.
WATCH_INTERVAL_S = 1.0

_manager: Optional[SyncManager] = None
_queue = None


def _end_with(worker: int) -> None:
    """Runs in the manager process before it serves: ignore the pre-emption signals, and exit
    once `worker` is no longer its parent (an orphan is adopted by init or a subreaper)."""
    for signum in (*PREEMPTION_SIGNALS, FORWARDED_REQUEST):
        signal.signal(signum, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == worker:
            time.sleep(WATCH_INTERVAL_S)
        os._exit(0)

    threading.Thread(target=watch, name="end-with-worker", daemon=True).start()


def results_queue():
    """Megatron's results queue (one per process, as megatron's own), served by a manager that
    ends with this process."""
    global _manager, _queue
    if _queue is None:
        _manager = SyncManager(ctx=mp.get_context("spawn"))  # megatron's context
        _manager.start(_end_with, (os.getpid(),))
        _queue = _manager.Queue()
    return _queue


def apply() -> None:
    """Make megatron's checkpoint writer use `results_queue`."""
    # heavy: megatron, off the launcher (platform/launch.py imports this module)
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._get_write_results_queue = results_queue
