"""SIGTERM / SIGUSR1: checkpoint at the next step boundary, then stop.

SLURM sends SIGUSR1 (`--signal=USR1@90`, submitit's `signal_delay_s`) or SIGTERM shortly before
a job's time limit or on preemption. Stopping mid-step would lose the step; instead every rank
notes the signal, the ranks agree after each step (one tiny all-reduce), save, and leave the
loop together. A handler that was installed before ours (submitit's requeue) is called after the
checkpoint is written, so it still does its job.
"""

from __future__ import annotations

import signal
import threading
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_ext.platform.device import current_device

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._previous: dict[int, Callable | int | None] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._note)

    def _note(self, signum, frame) -> None:
        self.signum = signum

    def agreed(self) -> bool:
        """True on every rank when any rank was signalled."""
        flag = torch.tensor([0 if self.signum is None else 1], device=current_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        """Give the signals back to their previous handlers, then let a chained handler see a
        signal that arrived here."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        previous = self._previous.get(self.signum)
        if self.signum is not None and callable(previous):
            previous(self.signum, None)
