"""Where the world comes from: torchrun's variables, an srun step's, or nothing (local)."""

from __future__ import annotations

import pytest

from megatron_ext.platform.launch import LaunchEnv, detect_launch, slurm_master_addr, slurm_master_port

CASES = [
    ("standalone", {}, None),
    (
        "torchrun",
        {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "2345"},
        LaunchEnv(3, 8, 1, "n1", 2345, "torchrun"),
    ),
    (
        "srun_step",
        {
            "SLURM_PROCID": "5",
            "SLURM_STEP_NUM_TASKS": "16",
            "SLURM_LOCALID": "1",
            "SLURM_JOB_NODELIST": "gpu07",
            "SLURM_JOB_ID": "123456",
        },
        LaunchEnv(5, 16, 1, "gpu07", 15000 + 123456 % 20000, "slurm"),
    ),
    (
        "srun_with_exported_master",
        {
            "SLURM_PROCID": "0",
            "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_JOB_NODELIST": "gpu07",
            "SLURM_JOB_ID": "1",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29500",
        },
        LaunchEnv(0, 2, 0, "10.0.0.1", 29500, "slurm"),
    ),
    # The batch script itself sees SLURM_NTASKS but is not one of the ranks.
    ("sbatch_script", {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "1"}, None),
    # torchrun inside srun: torchrun's variables win.
    (
        "torchrun_in_srun",
        {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "RANK": "7", "WORLD_SIZE": "16"},
        LaunchEnv(7, 16, 0, "127.0.0.1", 29500, "torchrun"),
    ),
]


@pytest.mark.parametrize("env, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_detect_launch(env, expected):
    assert detect_launch(env) == expected


def test_slurm_master_addr_without_scontrol(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert slurm_master_addr("node3,node4") == "node3"
    assert slurm_master_addr("gpu[01-04,07],cpu3") == "gpu01"


def test_slurm_master_port_is_in_user_range():
    ports = {slurm_master_port(str(job)) for job in range(0, 200000, 997)}
    assert min(ports) >= 15000 and max(ports) < 35000
