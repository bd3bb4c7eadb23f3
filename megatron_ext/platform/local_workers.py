"""The launcher's side of the workers `launch_local` starts: pre-emption signals and failures.

Signals (platform/signals.py): the launcher forwards the first pre-emption request to every
worker (as FORWARDED_REQUEST) and waits for them, while torch's elastic agent goes on
collecting their results (its own handler would stop collecting, so that workers that had saved
and returned waited for it until they were killed). A second request, or no exit within `launcher.preempt_timeout_s`,
aborts: the agent kills the workers (SIGKILL) and the launch raises LaunchAborted.

Failures: when a worker dies, the others fail on the connections to it soon after, and torch's
agent reports whichever of them it looked at first. A watcher thread notes the order in which
the workers end, and each worker that raises notes its error's first line (`note_failure`), so
that the launch names the first that failed of its own accord, not on a lost connection
(LaunchFailed, one line): under load the one that raised may end after a peer it took down. The
echoes of a failure go to the launch's log file (`LocalWorkers.log`, named by that line), not to
the terminal: the tracebacks of the workers that raised, torch's agent's report and its ending
of the other workers, and their notices of the signal it ends them with (`say_in_launch`). A
worker that refuses its input (bad input only the ranks can see: a damaged checkpoint) notes
its one line in the launch's folder and exits with REFUSED_EXIT_CODE; the launch then raises
LaunchRefused, and torch's agent's report of the failure is not printed at all.

Each worker writes its pid to the launch's folder when it starts (`register`): the launcher's
way to find its workers, which are the forkserver's children rather than its own.
"""

from __future__ import annotations

import _thread
import dataclasses
import logging
import multiprocessing
import os
import re
import shutil
import signal
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Optional

import psutil

from megatron_ext.platform.signals import (
    FORWARDED_REQUEST,
    PREEMPTION_SIGNALS,
    SignalCount,
    aborted_exit_code,
    say,
    signal_name,
)


class LaunchAborted(RuntimeError):
    """The workers were killed after a second pre-emption request or at the deadline."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class LaunchFailed(RuntimeError):
    """A worker failed: the message names the first one."""


class LaunchRefused(RuntimeError):
    """A worker refused its input: the message is its one line."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


# A worker that refused its input exits with this code (the command line's for bad input).
REFUSED_EXIT_CODE = 2
_REGISTERED = re.compile(r"(\d+)_(\d+)")  # attempt_localrank: a worker's pid
_REFUSED = re.compile(r"refused\.(\d+)")  # refused.rank: its one line
_FAILED = re.compile(r"failed\.(\d+)_(\d+)")  # failed.attempt_localrank: its error's first line
_ENDED = re.compile(r"ended\.(\d+)_(\d+)")  # ended.attempt_localrank: the worker's process ended
# How gloo and torch word a connection that a failed peer took down.
_LOST_CONNECTION = re.compile(r"connection (closed|reset)|(closed|reset) by peer|broken pipe", re.IGNORECASE)
_STOP_REQUESTED = "stop_requested"  # the launcher or a worker noted a pre-emption request


def register(folder: str) -> None:
    """In a worker: record this process as the worker of its local rank in this attempt."""
    attempt, rank = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), os.environ["LOCAL_RANK"]
    Path(folder, f"{attempt}_{rank}").write_text(str(os.getpid()))


def note_stop_request(folder: str) -> None:
    """In the launcher (a signal) or a worker (the ranks agreed to stop): mark that the job was
    asked to stop (it then ends rather than restart after a failure: no_restart_rendezvous.py)."""
    Path(folder, _STOP_REQUESTED).touch()


def why_not_restart(folder: str) -> Optional[str]:
    """Why the job of the launch in `folder` must end rather than restart after a failure
    (None: it may restart)."""
    names = os.listdir(folder)
    if _STOP_REQUESTED in names:
        return "the job was asked to stop"
    if any(_REFUSED.fullmatch(name) for name in names):
        return "a worker refused its input"
    return None


def note_refusal(folder: str, error: BaseException) -> None:
    """In a worker: record the first line of the input error it is about to exit on."""
    Path(folder, f"refused.{os.environ['RANK']}").write_text(first_line(error))


def note_failure(folder: str, log: str, error: BaseException) -> None:
    """In a worker, handling `error`: record the first line of the error it is about to fail
    on, and append its traceback to the launch's `log`."""
    attempt, rank = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), os.environ["LOCAL_RANK"]
    Path(folder, f"failed.{attempt}_{rank}").write_text(f"{type(error).__name__}: {first_line(error)}")
    _append(log, f"rank {os.environ['RANK']} (pid {os.getpid()}, attempt {attempt}) failed:\n{traceback.format_exc()}")


def say_in_launch(folder: str, log: str, line: str) -> None:
    """In a worker: say a notice on stderr (platform/signals.py `say`), or in the launch's `log`
    once a worker of its attempt has failed or ended: torch's agent then ends the others with
    SIGTERM, which is no request to save."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    ended = any(
        (m := _FAILED.fullmatch(name) or _ENDED.fullmatch(name)) and m.group(1) == attempt for name in os.listdir(folder)
    )
    if ended:
        _append(log, f"rank {os.environ['RANK']}: {line}\n")
    else:
        say(line)


def _append(log: str, text: str) -> None:
    """One write, appended whole: the workers and the launcher share the log."""
    with open(log, "a") as f:
        f.write(text)


@dataclasses.dataclass
class _Ended:
    attempt: int
    rank: int
    process: Any  # multiprocessing.Process


# The pre-emption signals, and those torch's agent may handle.
_HANDLED_BY_SOMEONE = (*PREEMPTION_SIGNALS, signal.SIGHUP, signal.SIGQUIT)

# A worker keeps its own deadline (the one that holds under srun) this much after its
# launcher's, which ends all workers at once.
WORKER_DEADLINE_GRACE_S = 10.0


class LocalWorkers:
    """Use as a context around torch's elastic launch (in the launcher's main thread); with
    `preemption`, it handles the pre-emption signals, with `deadline_s` (0: none)."""

    def __init__(self, preemption: bool, deadline_s: Optional[float]) -> None:
        self.folder = tempfile.mkdtemp(prefix="megatron_ext_workers_")
        # Kept after the launch when something was written to it (a failure's echoes).
        fd, self.log = tempfile.mkstemp(prefix="megatron_ext_launch_", suffix=".log")
        os.close(fd)
        self._log_named = False  # by LaunchFailed's line
        self.preemption, self.deadline_s = preemption, deadline_s
        self.worker_deadline_s = deadline_s + WORKER_DEADLINE_GRACE_S if deadline_s else None
        self.aborted: Optional[LaunchAborted] = None
        self._count = SignalCount()
        self._forwarding = False  # the first request came: forwarded to the workers
        self._expired = False
        self._deadline: Optional[threading.Timer] = None
        self._previous: dict[int, Any] = {}
        self._ended: list[_Ended] = []
        self._done = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="worker-watch", daemon=True)

    def __enter__(self) -> "LocalWorkers":
        self._records = _AgentRecords(self)
        for logger in _agent_loggers():
            logger.addFilter(self._records)
        if threading.current_thread() is threading.main_thread():
            # torch's agent installs handlers of its own and leaves them: this process (a test,
            # a notebook) gets its own back at the end
            self._previous = {sig: signal.getsignal(sig) for sig in _HANDLED_BY_SOMEONE}
            if self.preemption:
                for sig in PREEMPTION_SIGNALS:
                    signal.signal(sig, self._on_signal)
        self._watcher.start()
        return self

    def __exit__(self, *exc) -> None:
        for logger in _agent_loggers():
            logger.removeFilter(self._records)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._deadline is not None:
            self._deadline.cancel()
        self._done.set()
        self._watcher.join()
        if os.path.getsize(self.log) == 0 or self.refused():  # a refusal's line says it all
            os.unlink(self.log)
        elif not self._log_named:  # failed workers that were restarted, or an abort
            say(f"launcher: the errors of the workers that failed: {self.log}")
        shutil.rmtree(self.folder, ignore_errors=True)

    # --- pre-emption -----------------------------------------------------------------------

    def _on_signal(self, signum: int, frame) -> None:
        if self._expired:
            self._abort(f"no exit {self.deadline_s:g} s after {signal_name(self._count.first)}", self._count.first)
        if self._count.is_second_request(signum):
            self._abort(f"a second {signal_name(signum)}", signum)
        if self._forwarding:
            return  # the first request again, by another path
        # Set with no call since the check: at a call, the handler of the same request by another
        # path (the forkserver passes on what the group's signal brings it) runs inside this one.
        self._forwarding = True
        say(f"launcher: {signal_name(signum)}: forwarded to the workers, waiting for their checkpoint")
        note_stop_request(self.folder)
        self._forward()
        if self.deadline_s:
            self._deadline = threading.Timer(self.deadline_s, self._expire)
            self._deadline.daemon = True
            self._deadline.start()

    def _forward(self) -> None:
        mine = {p.pid for p in psutil.Process().children(recursive=True)}
        for pid in self._registered().values():
            if pid in mine:
                _request_stop(pid)

    def _tell_late_worker(self, pid: int) -> None:
        """Forward a request that came before this worker noted signals (it was starting)."""
        if self._count.first is not None:
            _request_stop(pid)

    def _expire(self) -> None:
        self._expired = True
        _thread.interrupt_main(self._count.first)  # runs _on_signal in the main thread

    def _abort(self, why: str, signum: int) -> None:
        """Make torch's agent kill the workers at once (it shuts them down with the signal of a
        SignalException raised in its loop)."""
        # torch: off the path of a refused command line (train.py imports this module)
        from torch.distributed.elastic.multiprocessing import SignalException

        message = f"aborted ({why}): workers killed; the last complete checkpoint stays"
        self.aborted = LaunchAborted(message, aborted_exit_code(signum))
        say(f"launcher: {message}")
        raise SignalException(message, sigval=signal.SIGKILL)

    # --- failures --------------------------------------------------------------------------

    def _registered(self) -> dict[tuple[int, int], int]:
        """(attempt, local rank) -> pid of every worker that started."""
        found = {}
        for path in Path(self.folder).iterdir():
            name = _REGISTERED.fullmatch(path.name)
            text = path.read_text() if name else ""
            if text:
                found[int(name.group(1)), int(name.group(2))] = int(text)
        return found

    def failing(self) -> bool:
        """Whether a worker of the launch's latest attempt has failed or ended."""
        attempt = max((a for a, _ in self._registered()), default=0)
        noted = any((m := _FAILED.fullmatch(name)) and int(m.group(1)) == attempt for name in os.listdir(self.folder))
        return noted or any(e.attempt == attempt for e in self._ended)

    def refused(self) -> bool:
        return any(_REFUSED.fullmatch(name) for name in os.listdir(self.folder))

    def keep(self, text: str) -> None:
        """Append `text` (lines) to the launch's log."""
        _append(self.log, text.rstrip("\n") + "\n")

    def refusal(self) -> Optional[LaunchRefused]:
        """The refusal of the lowest rank that refused its input, if one did."""
        refused = {
            int(name.group(1)): path
            for path in Path(self.folder).iterdir()
            if (name := _REFUSED.fullmatch(path.name))
        }
        if not refused:
            return None
        rank = min(refused)
        return LaunchRefused(refused[rank].read_text(), rank)

    def _watch(self) -> None:
        """Note the order in which the workers end. Their exit codes are read afterwards: the
        agent reads them while the workers run."""
        watched: dict[Any, _Ended] = {}  # sentinel -> worker
        known: set[tuple[int, int]] = set()
        while not self._done.is_set():
            new = {key: pid for key, pid in self._registered().items() if key not in known}
            if new:
                # Only while the new workers run: a process that ended here would be reaped by
                # active_children() itself, under the agent's feet.
                by_pid = {p.pid: p for p in multiprocessing.active_children()}
                for (attempt, rank), pid in new.items():
                    known.add((attempt, rank))  # looked for once: one that ended at once is lost
                    if pid in by_pid:
                        watched[by_pid[pid].sentinel] = _Ended(attempt, rank, by_pid[pid])
                        self._tell_late_worker(pid)
            if not watched:
                time.sleep(0.05)
                continue
            try:
                ready = wait(list(watched), timeout=0.05)
            except (OSError, ValueError):  # a sentinel closed under us: the order is lost
                watched.clear()
                continue
            for sentinel in ready:
                ended = watched.pop(sentinel)
                Path(self.folder, f"ended.{ended.attempt}_{ended.rank}").touch()  # for `say_in_launch`
                self._ended.append(ended)

    def failure(self, error: Exception) -> LaunchFailed:
        """What failed, from torch's ChildFailedError (or a refused restart): the first worker
        of the last attempt that ended with an error, and what ended it."""
        self._done.set()
        self._watcher.join()
        last = max((e.attempt for e in self._ended), default=0)
        failed = [e for e in self._ended if e.attempt == last and e.process.exitcode not in (0, None)]
        errors = self._noted_failures()
        # A worker killed by a signal notes nothing: it failed of its own accord too.
        causes = [e for e in failed if not _LOST_CONNECTION.search(errors.get((e.attempt, e.rank), ""))]
        logged = self._log_named = os.path.getsize(self.log) > 0
        if not failed:
            return LaunchFailed(first_line(error) + (f"; the launch's log: {self.log}" if logged else ""))
        first = (causes or failed)[0]
        status = _exit_status(first.process.exitcode)
        noted = errors.get((first.attempt, first.rank))
        kept = "its traceback and the other ranks' errors" if noted else "the other ranks' errors"
        echoes = f"; {kept} (which follow from it) are in {self.log}" if logged else ""
        return LaunchFailed(
            f"rank {first.rank} (pid {first.process.pid}) failed first: {f'{noted} ({status})' if noted else status}{echoes}"
        )

    def _noted_failures(self) -> dict[tuple[int, int], str]:
        """(attempt, local rank) -> the first line of the error each failed worker noted."""
        noted = {}
        for path in Path(self.folder).iterdir():
            if name := _FAILED.fullmatch(path.name):
                noted[int(name.group(1)), int(name.group(2))] = path.read_text()
        return noted


class _AgentRecords(logging.Filter):
    """Where the warnings and errors torch's agent logs go: its report of a failed worker (the
    traceback of whichever worker it looked at first, often one that only lost its connection to
    the failed one) and its ending of the others, to the launch's log once a worker failed (an
    error record is such a report itself), so that the terminal shows LaunchFailed's one line;
    nowhere once a worker refused its input (the refusal's one line says it all). Before, after
    an abort, and its progress (logged at INFO when asked for) always, where torch sends them."""

    def __init__(self, workers: LocalWorkers) -> None:
        super().__init__()
        self.workers = workers
        self.formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        if self.workers.refused():
            return False
        if self.workers.aborted is None and (record.levelno >= logging.ERROR or self.workers.failing()):
            self.workers.keep(self.formatter.format(record))
            return False
        return True


# The loggers of torch's elastic agent and of torch.multiprocessing, which starts and ends the
# workers for it (each logger filters only its own records).
_AGENT_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")


def _agent_loggers() -> list[logging.Logger]:
    loggers = logging.Logger.manager.loggerDict.items()
    return [lg for name, lg in loggers if name.startswith(_AGENT_LOGGERS) and isinstance(lg, logging.Logger)]


def _request_stop(pid: int) -> None:
    try:
        os.kill(pid, FORWARDED_REQUEST)
    except ProcessLookupError:
        pass


def _exit_status(code: int) -> str:
    if code < 0:
        return f"killed by {signal_name(-code)}"
    if code - 128 in {s.value for s in signal.Signals}:
        return f"exit code {code} ({signal_name(code - 128)})"
    return f"exit code {code}"


def first_line(error: Exception) -> str:
    """The first non-blank line of an error's message, else its type's name."""
    return next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
