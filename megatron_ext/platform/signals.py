"""Pre-emption signals, as SLURM, torchrun and a terminal deliver them.

SIGTERM (`scancel`, a time limit, torchrun), SIGINT (Ctrl-C) and SIGUSR1 (`sbatch
--signal=USR1@90`) ask the job to stop: every rank saves at the same step boundary and exits 0
(training/preemption.py). One request often reaches a process more than once: a signal to the
process group reaches every process, and the launcher forwards what it gets to its workers. So
a launcher forwards the request as FORWARDED_REQUEST, and the signals within SAME_REQUEST_S of
the first count as that one request (torchrun forwards the signal itself); a signal after that
is a second request, which aborts at once, as does no exit within the deadline (the last
complete checkpoint stays: saves are staged, see checkpointing/torch_dist.py).

A process notes the requests from the moment it installs `preemption_signals`: a worker started
by `launch_local` at its start, any other rank when `train.worker` begins. A handler that was
installed before (submitit's requeue) is called when the process is done with the signals, after
the checkpoint, so it still does its job. The processes a rank forks (megatron's checkpoint
writers, the background writer of an async save, data loader workers) inherit its handlers but
note nothing: a signal to the group reaches them too, and they go on with their work while their
rank decides.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any, Callable, Iterator, Optional

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
# How launch_local's launcher passes a request on to its workers: a signal of its own, never
# counted as a second request. (A worker signalled directly too, by a signal to the process
# group, may run its handlers late, after a long operation: the same signal, forwarded, would
# then look like a second request.)
FORWARDED_REQUEST = signal.SIGUSR2
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


class PreemptionSignals:
    """A worker's pre-emption requests: the first is noted (`signum`), a second one or no exit
    `deadline_s` after the first ends the process. `from_launcher`: also note FORWARDED_REQUEST
    (a worker of launch_local). `on_stop` is called when the ranks agreed to stop (`stopping`).
    `notices` writes what the process says of them (a line; default: stderr)."""

    def __init__(
        self,
        deadline_s: Optional[float] = None,
        from_launcher: bool = False,
        on_stop: Optional[Callable[[], None]] = None,
        notices: Optional[Callable[[str], None]] = None,
    ) -> None:
        self.deadline_s, self.on_stop = deadline_s, on_stop
        self.notices = notices or say
        self.signum: Optional[int] = None  # the first request's signal
        self._pid = os.getpid()
        self._count = SignalCount()  # of the signals sent to this process itself
        self._deadline: Optional[threading.Timer] = None
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in PREEMPTION_SIGNALS + ((FORWARDED_REQUEST,) if from_launcher else ()):
                self._previous[sig] = signal.signal(sig, self._note)

    def _note(self, signum: int, frame) -> None:
        if os.getpid() != self._pid:  # a process forked from this one (a checkpoint writer): its parent decides
            return
        if signum != FORWARDED_REQUEST and self._count.is_second_request(signum):
            _abort(f"a second {signal_name(signum)}", signum, self.notices)
        if self.signum is None:
            # Noted before any call: at a call, the handler of a signal that came meanwhile (the
            # same request by another path) runs inside this one, and must find it noted.
            self.signum = signum
            self._first(signum, "a request from the launcher" if signum == FORWARDED_REQUEST else signal_name(signum))

    def request(self, what: str) -> None:
        """Note a request that reached another process of the job (`what` says which), one
        that cannot take part in the ranks' agreement itself, as a forwarded request. From any
        thread."""
        if self.signum is None:
            self.signum = FORWARDED_REQUEST
            self._first(FORWARDED_REQUEST, what)

    def _first(self, signum: int, what: str) -> None:
        """Say that the first request (`signum`, noted) came, and start its deadline."""
        self.notices(f"[pid {os.getpid()}] {what}: saving a checkpoint at the next step boundary, then stopping")
        if self.deadline_s:
            why = f"no exit {self.deadline_s:g} s after {what}"
            code = signal.SIGTERM if signum == FORWARDED_REQUEST else signum
            self._deadline = threading.Timer(self.deadline_s, _abort, (why, code, self.notices))
            self._deadline.daemon = True
            self._deadline.start()

    def stopping(self) -> None:
        """The ranks agreed to stop (all of them were alive then): call `on_stop`, once."""
        on_stop, self.on_stop = self.on_stop, None
        if on_stop is not None:
            on_stop()

    def close(self) -> None:
        """Give the signals back to their previous handlers, then let a chained handler see a
        signal that arrived here (not Python's own SIGINT handler: it would raise
        KeyboardInterrupt after a clean stop)."""
        if self._deadline is not None:
            self._deadline.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        previous = self._previous.get(self.signum)
        chained = callable(previous) and previous is not signal.default_int_handler
        if self.signum in PREEMPTION_SIGNALS and chained:
            previous(self.signum, None)


_CURRENT: Optional[PreemptionSignals] = None


@contextlib.contextmanager
def preemption_signals(
    deadline_s: Optional[float] = None,
    from_launcher: bool = False,
    on_stop: Optional[Callable[[], None]] = None,
    notices: Optional[Callable[[str], None]] = None,
) -> Iterator[PreemptionSignals]:
    """This process's PreemptionSignals: the one installed further out (a local worker's, from
    its start), or new ones for the duration of the block."""
    global _CURRENT
    if _CURRENT is not None:
        yield _CURRENT
        return
    _CURRENT = signals = PreemptionSignals(deadline_s, from_launcher, on_stop, notices)
    try:
        yield signals
    finally:
        _CURRENT = None
        signals.close()


def _abort(why: str, signum: int, notices: Callable[[str], None]) -> None:
    """End this process now: a save in progress stays unpublished, the last complete checkpoint
    stays the latest."""
    notices(f"[pid {os.getpid()}] aborting ({why}); the last complete checkpoint stays")
    os._exit(aborted_exit_code(signum))


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def aborted_exit_code(signum: int) -> int:
    """The shell's exit status of a process ended by signal `signum`."""
    return 128 + signum


def say(line: str) -> None:
    """Write one line to stderr from a signal handler (print may be inside a write already)."""
    os.write(2, (line.rstrip("\n") + "\n").encode())
