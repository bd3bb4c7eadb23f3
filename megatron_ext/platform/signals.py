"""Pre-emption signals, as SLURM, torchrun and a terminal deliver them.

SIGTERM (`scancel`, a time limit, torchrun), SIGINT (Ctrl-C) and SIGUSR1 (`sbatch
--signal=USR1@90`) ask the job to stop: every rank saves at the same step boundary and exits 0.
One request often reaches a process more than once: a signal to the process group reaches every
process, and the launcher forwards what it gets to its workers. So the signals within
SAME_REQUEST_S of the first count as that one request; a signal after that is a second request,
which aborts at once (the last complete checkpoint stays: saves are staged, see
training/checkpoint.py).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Optional

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
# The ones launch_local's forkserver passes on to the launcher (forkserver_signals.py); it
# ignores SIGINT.
FORWARDED_BY_FORKSERVER = (signal.SIGTERM, signal.SIGUSR1)

# A forwarded signal arrives within milliseconds of the original; a person's second Ctrl-C or a
# scheduler's next signal comes later.
SAME_REQUEST_S = 1.0


class SignalCount:
    """The pre-emption requests a process received: the first signal, and whether a later one
    is a second request."""

    def __init__(self) -> None:
        self.first: Optional[int] = None
        self._first_at = 0.0

    def is_second_request(self, signum: int) -> bool:
        """Count signal `signum`: True when it is a second request."""
        now = time.monotonic()
        if self.first is None:
            self.first, self._first_at = signum, now
            return False
        return now - self._first_at >= SAME_REQUEST_S


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def aborted_exit_code(signum: int) -> int:
    """The shell's exit status of a process ended by signal `signum`."""
    return 128 + signum


def say(line: str) -> None:
    """Write one line to stderr from a signal handler (print may be inside a write already)."""
    os.write(2, (line.rstrip("\n") + "\n").encode())
