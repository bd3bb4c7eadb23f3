"""Run a test file's worker half as N gloo ranks, from its pytest half.

The ranks are started by the runtime's own `launch_local` (torch's elastic agent, as torchrun),
forked from the one server process that imported megatron for the whole test session. A test
that puts another copy of a library first on the path (`extra_path`) gets fresh processes from
torchrun itself instead: the server has imported the usual one.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from megatron_ext.platform.launch import launch_local

REPO = Path(__file__).resolve().parents[2]


class _Script:
    """A worker that runs `path` as `__main__` with `args`, as `python path args` would."""

    def __init__(self, path: str, args: tuple) -> None:
        self.path, self.args = path, args
        self.__name__ = self.__qualname__ = Path(path).stem  # the elastic agent names the job so

    def __call__(self) -> None:
        sys.argv = [self.path, *self.args]
        sys.path.insert(0, str(Path(self.path).parent))
        runpy.run_path(self.path, run_name="__main__")


def torchrun(script: str, nproc: int, *args: str, extra_path: Sequence[str] = (), timeout: int = 600) -> None:
    """`python script args` as `nproc` ranks. `timeout` bounds a torchrun subprocess; ranks
    started in this process are bounded by pytest's own timeout."""
    if not extra_path:
        launch_local(nproc, _Script(str(script), args), (), "127.0.0.1", 0)
        return
    path = os.pathsep.join([*extra_path, str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    command = [sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(nproc), script, *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def rank_reports(out: Path, world: int) -> list:
    """What each rank wrote to `out/rank{r}.json`."""
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
