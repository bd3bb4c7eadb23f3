"""Python's resource tracker lives through the pre-emption signals.

multiprocessing starts one helper process that frees the semaphores and shared memory its users
leave behind: the launcher's, which the workers it forks share, or each rank's own under torchrun
or srun. It is in the job's process group, so a signal to the group reaches it too. Python has it
ignore SIGINT and SIGTERM, but SIGUSR1 (SLURM's `--signal=USR1` warning, a `kill -USR1` to the
group) would end it: the processes that use it then start another, which fails on every
resource they registered with the first (a traceback each on stderr), and those may leak. Started
here with SIGUSR1 ignored, a disposition its `exec` keeps, it outlives the warning as the job's
other helpers do (writer_queue.py, forkserver_signals.py); the ranks decide when to stop.
"""

from __future__ import annotations

import signal
import threading
from multiprocessing import resource_tracker


def start() -> None:
    """Start this process's resource tracker, unless one runs, with SIGUSR1 ignored. Only from
    the main thread, where dispositions are set; elsewhere multiprocessing starts it as it does."""
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        resource_tracker.ensure_running()
    finally:
        signal.signal(signal.SIGUSR1, previous)
