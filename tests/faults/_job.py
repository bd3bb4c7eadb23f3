"""`python -m megatron_ext.train` as a job an operator or a cluster signals, for the fault
tests: a subprocess in its own session (its own process group, as `srun` or a terminal makes),
its output and its error lines collected as they come, its processes found in the process table.
The test plugins of tests/faults/_faults.py are importable by it (MEGATRON_EXT_PLUGINS)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

import psutil

REPO = Path(__file__).resolve().parents[2]

# Tiny settings: 4 CPU workers, a few hundred tokens a step, a step line each step; a run that
# only a signal ends.
TINY = [
    "experiment=none",
    "launcher.nproc=4",
    "train.iters=100000",
    "train.eval_interval=0",
    "logging.progress_bar=false",
    "logging.log_interval=1",
    "model.seq_length=32",
    "train.micro_batch_size=1",
    "train.global_batch_size=4",
]

_STEP = re.compile(r"^iter\s+(\d+)/")


class Job:
    """`python -m megatron_ext.train overrides` (or `python *entry overrides`), with `env` added
    to this process's environment."""

    def __init__(
        self, overrides: Sequence[str], timeout_s: float = 240, entry: Sequence[str] = ("-m", "megatron_ext.train"), **env: str
    ) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO), **env)
        self.process = subprocess.Popen(
            [sys.executable, *entry, *overrides],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.timeout_s = timeout_s
        self.lines: list[str] = []  # stdout's
        self.error_lines: list[str] = []  # stderr's
        self._readers = [
            threading.Thread(target=self._read, args=(stream, into), daemon=True)
            for stream, into in ((self.process.stdout, self.lines), (self.process.stderr, self.error_lines))
        ]
        for reader in self._readers:
            reader.start()
        self._tree: list[psutil.Process] = []  # the job's processes, once it runs
        self.workers_at_start: list[psutil.Process] = []

    @staticmethod
    def _read(stream, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    @property
    def output(self) -> str:
        """stdout, then stderr."""
        return "".join(self.lines + self.error_lines)

    @property
    def errors(self) -> list[str]:
        """The lines on stderr, without their newlines."""
        return [line.rstrip("\n") for line in self.error_lines]

    def last_step(self) -> int:
        steps = [int(m.group(1)) for line in self.lines if (m := _STEP.match(line))]
        return max(steps, default=0)

    def wait_for_step(self, step: int) -> None:
        """Until the job has logged `step` (and every process of it exists)."""
        self.wait_until(lambda: self.last_step() >= step, f"step {step}")
        self.snapshot()

    def wait_for_workers(self, count: int) -> None:
        """Until `count` workers exist (they are starting: importing, building the model)."""

        def started() -> bool:
            try:
                return len(self.workers) >= count
            except psutil.NoSuchProcess:
                return False

        self.wait_until(started, f"{count} workers", poll_s=0.005)
        self.snapshot()

    def snapshot(self) -> None:
        """Note the job's processes as they are now: those `left_behind` looks for."""
        self._tree = self.launcher.children(recursive=True)
        self.workers_at_start = self.workers

    def wait_until(self, condition, what: str, poll_s: float = 0.02) -> None:
        end = time.monotonic() + self.timeout_s
        while not condition():
            if self.process.poll() is not None:
                rc = self.process.returncode
                raise AssertionError(f"the job ended (rc {rc}) before {what}:\n{self.output[-4000:]}")
            if time.monotonic() > end:
                self.kill()
                raise AssertionError(f"no {what} within {self.timeout_s} s:\n{self.output[-4000:]}")
            time.sleep(poll_s)

    # --- its processes -----------------------------------------------------------------------

    @property
    def launcher(self) -> psutil.Process:
        return psutil.Process(self.process.pid)

    @property
    def forkserver(self) -> Optional[psutil.Process]:
        """The server the workers are forked from; None for a job of one process (no workers)."""
        return next((p for p in self.launcher.children() if "multiprocessing.forkserver" in " ".join(p.cmdline())), None)

    @property
    def workers(self) -> list[psutil.Process]:
        server = self.forkserver
        return server.children() if server is not None else []

    def processes(self) -> list[psutil.Process]:
        """The launcher and every process under it."""
        return [self.launcher, *self.launcher.children(recursive=True)]

    def signal(self, target: str, signum: int) -> Optional[int]:
        """Send `signum` to `target`: group | launcher | forkserver | worker (rank 1's process,
        by start order) | last worker (the last rank's). Returns the pid signalled (the group's
        leader for group)."""
        if target == "group":
            os.killpg(self.process.pid, signum)
            return self.process.pid
        by_start = lambda: sorted(self.workers, key=lambda p: p.create_time())  # noqa: E731
        process = {
            "launcher": lambda: self.launcher,
            "forkserver": lambda: self.forkserver,
            "worker": lambda: by_start()[1],
            "last worker": lambda: by_start()[-1],
        }[target]()
        process.send_signal(signum)
        return process.pid

    # --- its end -------------------------------------------------------------------------------

    def wait(self) -> int:
        try:
            self.process.wait(self.timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the job did not end within {self.timeout_s} s:\n{self.output[-4000:]}") from None
        for reader in self._readers:
            reader.join(10)
        return self.process.returncode

    def left_behind(self, grace_s: float = 5.0) -> list[psutil.Process]:
        """The job's processes still alive `grace_s` after it ended (none, for a job that
        leaves no orphan)."""
        end = time.monotonic() + grace_s
        alive = self._tree
        while alive and time.monotonic() < end:
            alive = [p for p in alive if _running(p)]
            time.sleep(0.1)
        return alive

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_job(overrides: Sequence[str], timeout_s: float = 240, **env: str) -> tuple[int, str]:
    """A job run to its end: (exit code, output)."""
    job = Job(overrides, timeout_s, **env)
    return job.wait(), job.output


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
