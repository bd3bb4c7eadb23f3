"""The provenance record each benchmark writes into its JSON under `provenance`: the command, the
commit and whether the tree had uncommitted changes, the machine (CPU model, cores, load average),
the date, and the versions of Python, torch and megatron-core. `results_pages.py` puts it on the
results page, so a number there says what produced it."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parents[2]


def _git(*args: str) -> Optional[str]:
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it (platform.processor() is often empty on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> Optional[str]:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def command_line(script: str, argv: Sequence[str]) -> str:
    """`python <script relative to the repository> <argv>`, quoted for a shell."""
    path = Path(script).resolve()
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    return shlex.join(["python", str(shown), *argv])


def provenance(script: str, argv: Optional[Sequence[str]] = None) -> dict:
    """The record for a run of `script` with `argv` (default: this process's arguments)."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "command": command_line(script, sys.argv[1:] if argv is None else argv),
        "commit": _git("rev-parse", "HEAD"),
        # tracked files changed but not committed: the commit alone does not reproduce the run
        "dirty": None if status is None else bool(status),
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],  # 1, 5 and 15 minutes, when the JSON is written
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "megatron_core": _version("megatron-core"),
    }
