"""One writer per checkpoint directory: the run that saves to `checkpoint.save` holds an `flock`
on `<checkpoint.save>/.writer.lock` for its whole life, and a second run given the directory is
refused before any of its workers starts (training/preflight.py, train.py).

    <dir>/.writer.lock   {"host": ..., "pid": ..., "since": ...} of the run that holds it

The holder is the process that owns the run: the launcher of local workers (it outlives them,
restarts included), the process itself for a run of one, rank 0 under torchrun or srun. The lock
is the kernel's: it ends with the process however the process ends (an exception, SIGKILL), once
the processes it forked and that share it have ended too (megatron's checkpoint writers, forked
for a save, end when their shard is written). So a lock file that a dead run left is free, and
the next run takes it over with a notice naming the run that left it. A run that ends releases
it and empties the record.

Only the holder removes leftover staging folders of broken saves (`take`, right after the lock
is taken: no other run can be writing there then).

What is guaranteed: `flock` excludes processes of one host on a local filesystem, and processes
of several hosts where the filesystem carries locks between its clients (NFSv4; NFSv3 with its
lock manager, not mounted `nolock` or `local_lock=flock`; Lustre mounted with `-o flock`).
Elsewhere (Lustre's `localflock`, NFS with local locks) each host sees only its own locks: two
runs on two hosts are not kept apart. A filesystem that refuses `flock` (Lustre's default
`noflock`) gets a warning, and the run goes on unlocked.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Optional

from megatron_ext.checkpointing.tracker import LOCK_FILE, remove_leftover_staging
from megatron_ext.config.validate import ConfigError

FIELD = "checkpoint.save"  # what a refusal names
# A holder writes its record right after it took the lock: how long a reader waits for it.
RECORD_WAIT_S = 2.0
# A lock found held is tried again this long before the run is refused: `check_free` holds it
# for an instant.
BUSY_RETRY_S = 0.5


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who holds (or last held) a directory's writer lock."""

    host: str
    pid: int
    since: str  # local time of the lock's taking

    def __str__(self) -> str:
        return f"pid {self.pid} on host {self.host} (since {self.since})"


class WriterLock:
    """A directory's writer lock held by this process (`fd` None: the filesystem has no
    locks, `unlocked_because` says why). `previous`: the run that held it last and ended
    without releasing it (None when it was released, or never held)."""

    def __init__(self, fd: Optional[int], previous: Optional[Holder] = None, unlocked_because: Optional[str] = None) -> None:
        self.fd, self.previous, self.unlocked_because = fd, previous, unlocked_because

    def release(self) -> None:
        """Empty the record and give the lock up."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # the lock goes with the last descriptor of the open file


def take(root: str | os.PathLike) -> WriterLock:
    """Take `root`'s writer lock (`root` exists) for this process, then remove the leftover
    staging folders of broken saves. Raises ConfigError (checkpoint.save) naming the holder's
    host and pid when another run holds it."""
    path = Path(root, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise ConfigError(FIELD, f"{path} cannot be opened to lock {root} ({e.strerror or e})") from None
    try:
        _lock(fd, fcntl.LOCK_EX, root)
    except ConfigError:
        os.close(fd)
        raise
    except OSError as e:  # the filesystem has no locks
        os.close(fd)
        return WriterLock(None, unlocked_because=e.strerror or str(e))
    previous = _record(fd)
    _write_record(fd, Holder(socket.gethostname(), os.getpid(), time.strftime("%Y-%m-%d %H:%M:%S")))
    remove_leftover_staging(root)
    return WriterLock(fd, previous)


def check_free(root: str | os.PathLike) -> None:
    """Raise ConfigError as `take` does when another run holds `root`'s writer lock; writes
    nothing (for the start of the preflight, before the checks that take seconds)."""
    try:
        fd = os.open(Path(root, LOCK_FILE), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no lock file (or none readable): `take` decides
        return
    try:
        _lock(fd, fcntl.LOCK_SH, root)
    except OSError:  # the filesystem has no locks: `take` says so
        pass
    finally:
        os.close(fd)


def _lock(fd: int, kind: int, root: str | os.PathLike) -> None:
    """flock `fd` (`kind`: shared or exclusive) without waiting for a holder, trying again for
    BUSY_RETRY_S; raises ConfigError naming the holder when it stays held."""
    end = time.monotonic() + BUSY_RETRY_S
    while True:
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
        if time.monotonic() > end:
            break
        time.sleep(0.05)
    holder = _record(fd, wait_s=RECORD_WAIT_S)
    raise ConfigError(FIELD, f"{root} is in use by {holder or 'another run (its record is unreadable)'}")


def _record(fd: int, wait_s: float = 0.0) -> Optional[Holder]:
    """The holder `fd`'s file records (None: empty or unreadable), waiting up to `wait_s` for
    a record being written."""
    end = time.monotonic() + wait_s
    while True:
        try:
            return Holder(**json.loads(os.pread(fd, 4096, 0)))
        except (ValueError, TypeError):  # empty, half-written or not ours
            if time.monotonic() > end:
                return None
            time.sleep(0.05)


def _write_record(fd: int, holder: Holder) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(dataclasses.asdict(holder)) + "\n").encode(), 0)
    os.fsync(fd)  # seen by a reader on another host
