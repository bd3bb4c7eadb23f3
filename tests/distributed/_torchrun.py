"""Run a test file's worker half under torchrun as N gloo ranks, from its pytest half."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[2]


def torchrun(script: str, nproc: int, *args: str, extra_path: Sequence[str] = (), timeout: int = 600) -> None:
    path = os.pathsep.join([*extra_path, str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    command = [sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(nproc), script, *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def rank_reports(out: Path, world: int) -> list:
    """What each rank wrote to `out/rank{r}.json`."""
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
