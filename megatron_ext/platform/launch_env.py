"""The world an outside launcher made, read from its environment variables: torchrun's, or
SLURM's for `srun` (one task per rank). Imports no torch: the configuration's checks ask it how
many processes a run will have.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    # torchrun | slurm | local
    source: str
    # torchrun's elastic agent hosts the rendezvous store (else rank 0 does) and restarts
    # failed jobs: this is the attempt's number.
    agent_store: bool = False
    restart: int = 0
    # The one address rank 0's store listens on (a local launch: launcher.master_addr); None:
    # every interface, as torchrun's (several hosts).
    listen_on: Optional[str] = None


# Set by launch_local for its workers: the address their ports are bound to.
LISTEN_ON_ENV = "MEGATRON_EXT_LISTEN_ON"


def slurm_master_port(job_id: str) -> int:
    """A port every task of a SLURM job derives alike without talking to the others."""
    return 15000 + int(job_id) % 20000


def slurm_master_addr(nodelist: str) -> str:
    """The first host of the job's node list (`scontrol` expands ranges like node[01-04])."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
        ).stdout
        return out.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        # No scontrol: the first host of "a,b" or "gpu[01-04,07],cpu3" read by hand.
        prefix, ranges = re.match(r"([^\[,]+)(?:\[([^\]]+)\])?", nodelist).groups()
        return prefix + (ranges.split(",")[0].split("-")[0] if ranges else "")


def detect_launch(environ: Optional[dict] = None) -> Optional[LaunchEnv]:
    """The world an outside launcher made, or None when this process was started on its own."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun, or anything that exports its variables
        return LaunchEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            source="torchrun",
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            restart=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
            listen_on=env.get(LISTEN_ON_ENV),
        )
    # srun, one task per rank. SLURM_STEP_NUM_TASKS is set inside an srun step only; the batch
    # script itself also sees SLURM_NTASKS and must not mistake itself for one of N ranks.
    if "SLURM_PROCID" in env and int(env.get("SLURM_STEP_NUM_TASKS", "1")) > 1:
        return LaunchEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_STEP_NUM_TASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=env.get("MASTER_ADDR") or slurm_master_addr(env["SLURM_JOB_NODELIST"]),
            master_port=int(env.get("MASTER_PORT") or slurm_master_port(env["SLURM_JOB_ID"])),
            source="slurm",
        )
    return None
