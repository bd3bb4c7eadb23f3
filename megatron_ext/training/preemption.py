"""SIGTERM / SIGINT / SIGUSR1: checkpoint at the next step boundary, then stop.

SLURM sends SIGUSR1 (`--signal=USR1@90`, submitit's `signal_delay_s`) or SIGTERM shortly before
a job's time limit or on preemption; `scancel` and Ctrl-C signal every process of the job.
Stopping mid-step would lose the step; instead every rank notes the signal, the ranks agree after
each step (one tiny all-reduce), save, and leave the loop together. A second request
(platform/signals.py), or no exit within the deadline, aborts the process at once: the last
complete checkpoint stays. A handler that was installed before ours (submitit's requeue) is
called after the checkpoint is written, so it still does its job.

A worker process installs its StopRequest when it starts (`stop_request` in train.py), so a
signal during setup is noted too; the trainer's loop uses that one, or its own when it runs
without (notebooks, tests that train in-process).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_ext.platform.device import current_device
from megatron_ext.platform.signals import PREEMPTION_SIGNALS, SignalCount, aborted_exit_code, say, signal_name

# A worker of a local launch leaves the deadline to its launcher, which ends all workers at
# once; this grace keeps a worker's own deadline (the one that holds under srun) after it.
WORKER_DEADLINE_GRACE_S = 10.0


class StopRequest:
    def __init__(self, deadline_s: Optional[float] = None) -> None:
        self.deadline_s = deadline_s
        self._count = SignalCount()
        self._deadline: Optional[threading.Timer] = None
        self._previous: dict[int, Callable | int | None] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in PREEMPTION_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._note)

    @property
    def signum(self) -> Optional[int]:
        """The first pre-emption signal this process received, if any."""
        return self._count.first

    def _note(self, signum, frame) -> None:
        first = self.signum is None
        if self._count.is_second_request(signum):
            _abort(f"a second {signal_name(signum)}", signum)
        if first:
            say(f"[pid {os.getpid()}] {signal_name(signum)}: saving a checkpoint at the next step boundary, then stopping")
            if self.deadline_s:
                deadline = self.deadline_s + WORKER_DEADLINE_GRACE_S
                why = f"no exit {deadline:g} s after {signal_name(signum)}"
                self._deadline = threading.Timer(deadline, _abort, (why, signum))
                self._deadline.daemon = True
                self._deadline.start()

    def agreed(self) -> bool:
        """True on every rank when any rank was signalled."""
        flag = torch.tensor([0 if self.signum is None else 1], device=current_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        """Give the signals back to their previous handlers, then let a chained handler see a
        signal that arrived here (not Python's own SIGINT handler: it would raise
        KeyboardInterrupt after a clean stop)."""
        if self._deadline is not None:
            self._deadline.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        previous = self._previous.get(self.signum)
        if self.signum is not None and callable(previous) and previous is not signal.default_int_handler:
            previous(self.signum, None)


def _abort(why: str, signum: int) -> None:
    """End this process now: a save in progress stays unpublished, the last complete checkpoint
    stays the latest."""
    say(f"[pid {os.getpid()}] aborting ({why}); the last complete checkpoint stays")
    os._exit(aborted_exit_code(signum))


_CURRENT: Optional[StopRequest] = None


@contextlib.contextmanager
def stop_request(deadline_s: Optional[float] = None) -> Iterator[StopRequest]:
    """This process's StopRequest: the one installed further out (a worker's, from its start),
    or a new one for the duration of the block."""
    global _CURRENT
    if _CURRENT is not None:
        yield _CURRENT
        return
    _CURRENT = request = StopRequest(deadline_s)
    try:
        yield request
    finally:
        _CURRENT = None
        request.close()
