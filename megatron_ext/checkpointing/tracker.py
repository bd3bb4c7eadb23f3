"""Where megatron's checkpoint layout keeps things, readable without torch or megatron (the
launcher checks checkpoints before it starts any worker, see training/preflight.py):

    <dir>/iter_0000100/                     one checkpoint
    <dir>/latest_checkpointed_iteration.txt the tracker: the newest complete iteration
    <dir>/.iter_0000100.tmp/                checkpoint 100 being saved (renamed when complete)
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Optional

TRACKER = "latest_checkpointed_iteration.txt"
# The lock of the run that writes the directory (writer_lock.py): not part of any checkpoint.
LOCK_FILE = ".writer.lock"


def iteration_dir(root: str | os.PathLike, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def staging_dir(root: str | os.PathLike, iteration: int) -> Path:
    """Where checkpoint `iteration` is written before it is renamed into place."""
    return Path(root) / f".{iteration_dir(root, iteration).name}.tmp"


def remove_leftover_staging(root: str | os.PathLike) -> list[Path]:
    """Remove the staging folders of saves that never completed; returns them. Only for the
    holder of the directory's writer lock (writer_lock.py), which no other run writes to."""
    leftovers = sorted(Path(root).glob(".iter_*.tmp"))
    for folder in leftovers:
        shutil.rmtree(folder, ignore_errors=True)
    return leftovers


def latest_iteration(root: str | os.PathLike) -> Optional[int]:
    """The tracker's iteration; None when `root` has no tracker. A tracker that does not hold
    an iteration number raises ValueError naming its path."""
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{tracker} does not hold an iteration number: {text[:40]!r}")
    return int(text)


def saved_iterations(root: str | os.PathLike) -> list[int]:
    """The iterations whose checkpoint folders are under `root`, oldest first."""
    if not Path(root).is_dir():
        return []
    return sorted(int(m.group(1)) for p in Path(root).iterdir() if (m := re.fullmatch(r"iter_(\d{7})", p.name)))


def holds_files(root: str | os.PathLike) -> bool:
    """Whether `root` is a folder holding anything besides a writing run's lock: a folder that
    does not is where a first run of `checkpoint.save=X checkpoint.load=X` starts fresh."""
    return Path(root).is_dir() and any(p.name != LOCK_FILE for p in Path(root).iterdir())
