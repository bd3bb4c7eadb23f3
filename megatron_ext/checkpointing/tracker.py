"""Where megatron's checkpoint layout keeps things, readable without torch or megatron (the
launcher checks checkpoints before it starts any worker, see training/preflight.py):

    <dir>/iter_0000100/                     one checkpoint
    <dir>/latest_checkpointed_iteration.txt the tracker: the newest complete iteration
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

TRACKER = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str | os.PathLike, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


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
