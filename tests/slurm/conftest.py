"""The local SLURM cluster of scripts/slurm/local_cluster.sh: the one running already (.ci/run
starts it), else one started here for the session and stopped after it. Where it cannot be
started (the packages cannot be installed, not root, no sudo) the tests are skipped, with the
script's own reason."""

from __future__ import annotations

import os
import subprocess
from typing import Iterator

import pytest

from tests.slurm._jobs import SLURM_DIR, TASKS, cancel_submitted

LOCAL_CLUSTER = SLURM_DIR / "local_cluster.sh"


def _cluster(command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(LOCAL_CLUSTER), command], capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="session")
def slurm_conf() -> Iterator[str]:
    """SLURM_CONF of a running one-node cluster on localhost."""
    if len(os.sched_getaffinity(0)) < TASKS:
        pytest.skip(f"the SLURM tests run {TASKS} tasks of one CPU each; this machine has fewer CPUs")
    started_here = _cluster("status").returncode != 0
    if started_here:
        start = _cluster("start")
        if start.returncode != 0:
            reason = (start.stderr.strip().splitlines() or ["no reason given"])[-1]
            pytest.skip(f"no local SLURM cluster: {reason}")
    conf = _cluster("env").stdout.strip().removeprefix("export SLURM_CONF=")
    try:
        yield conf
    finally:
        if started_here:
            _cluster("stop")


@pytest.fixture(autouse=True)
def no_job_left_behind() -> Iterator[None]:
    """A test that fails while its job runs must not leave the node busy for the next one."""
    yield
    cancel_submitted()
