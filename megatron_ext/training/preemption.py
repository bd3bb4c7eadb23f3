"""SIGTERM / SIGINT / SIGUSR1: checkpoint at the next step boundary, then stop.

SLURM sends SIGUSR1 (`--signal=USR1@90`, submitit's `signal_delay_s`) or SIGTERM shortly before
a job's time limit or on preemption; `scancel` and Ctrl-C signal every process of the job.
Stopping mid-step would lose the step; instead every rank notes the signal (platform/signals.py,
from the rank's start), the ranks agree after each step (one tiny all-reduce), save, and leave
the loop together.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megatron_ext.platform.device import current_device
from megatron_ext.platform.signals import PreemptionSignals, preemption_signals


class StopRequest:
    def __init__(self, signals: PreemptionSignals) -> None:
        self.signals = signals

    @property
    def signum(self) -> Optional[int]:
        return self.signals.signum

    def agreed(self) -> bool:
        """True on every rank when any rank was signalled."""
        flag = torch.tensor([0 if self.signum is None else 1], device=current_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        agreed = bool(flag.item())
        if agreed:
            self.signals.stopping()
        return agreed


@contextlib.contextmanager
def stop_request(deadline_s: Optional[float] = None) -> Iterator[StopRequest]:
    """The ranks' agreement on this process's pre-emption signals: those installed further out
    (a worker's, from its start), or ones noted for the duration of the block."""
    with preemption_signals(deadline_s) as signals:
        yield StopRequest(signals)
