"""A full disk, said as such: the path being written and the space left on its filesystem.

A write that runs out of space rarely says where: numpy and the OS give `[Errno 28] No space
left on device` without a path, torch's zip writer `inline_container.cc:672 unexpected pos`
(a write came up short), and megatron's checkpoint writers report the cause on the coordinating
rank only (the others see an empty CheckpointException). So a failure counts as a full disk when
its own words or errno say so, or when the filesystem it was writing to has almost no space
left after it.
"""

from __future__ import annotations

import errno
import os
import shutil
from typing import Optional

# What a failed write says when the disk is full: the OS's words, torch's zip writer's.
SIGNS = ("No space left on device", "unexpected pos")
# Less than this left after a failed write: the disk was full (a checkpoint shard, an index,
# is larger).
NEARLY_FULL_BYTES = 64 * 2**20


def disk_full(error: BaseException, path: str | os.PathLike) -> Optional[str]:
    """If `error`, raised while writing under `path`, comes from a full disk: one line naming
    `path` and the space left; otherwise None."""
    code = getattr(error, "errno", None)
    if code is not None and code != errno.ENOSPC:  # an OSError that says what else it is
        return None
    free = free_space(path)
    if not (_says_so(error) or (free is not None and free[0] < NEARLY_FULL_BYTES)):
        return None
    left = f"{_size(free[0])} free of {_size(free[1])}" if free else "its free space unknown"
    return f"{os.fspath(path)}: no space left on its filesystem ({left})"


def free_space(path: str | os.PathLike) -> Optional[tuple[int, int]]:
    """(free, total) bytes of the filesystem holding `path` or its nearest existing parent."""
    path = os.path.abspath(os.fspath(path))
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return None
    return usage.free, usage.total


def _says_so(error: BaseException) -> bool:
    seen: set[int] = set()
    pending = [error]
    while pending:
        e = pending.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if getattr(e, "errno", None) == errno.ENOSPC or any(sign in str(e) for sign in SIGNS):
            return True
        pending.extend(c for c in (e.__cause__, e.__context__) if c is not None)
        # torch's CheckpointException: {rank: (exception, traceback)} of the writers that failed
        for failure in (getattr(e, "failures", None) or {}).values():
            pending.extend(f for f in (failure if isinstance(failure, tuple) else (failure,)) if isinstance(f, BaseException))
    return False


def _size(count: int) -> str:
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.1f} {unit}" if unit != "B" else f"{count} B"
        size /= 1024
    return f"{size:.1f} TiB"
