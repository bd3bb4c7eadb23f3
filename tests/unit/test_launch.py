"""Where the world comes from: torchrun's variables, an srun step's, or nothing (local); and
what the local workers see."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from megatron_ext.platform.launch import launch_local
from megatron_ext.platform.launch_env import LaunchEnv, detect_launch, slurm_master_addr, slurm_master_port

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


def what_a_worker_sees(names: tuple) -> tuple:
    return {name: os.environ.get(name) for name in names}, torch.get_num_threads(), os.getcwd(), sys.path


@pytest.mark.distributed
def test_local_workers_see_the_launcher_as_it_is_at_each_launch(monkeypatch, tmp_path):
    """Workers forked from a server started at an earlier launch still see the launcher's
    environment (set and removed variables), working directory and import path as they are
    now, the agent's per-rank variables, and the OpenMP threads asked for."""
    names = ("MEGATRON_EXT_TEST_EARLIER", "MEGATRON_EXT_TEST_LATER", "RANK", "OMP_NUM_THREADS")
    monkeypatch.setenv("MEGATRON_EXT_TEST_EARLIER", "set before the first launch")
    launch_local(2, what_a_worker_sees, (names,), "127.0.0.1", 0)  # starts the server if none is
    monkeypatch.delenv("MEGATRON_EXT_TEST_EARLIER")
    monkeypatch.setenv("MEGATRON_EXT_TEST_LATER", "set after it")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "later"))
    seen = launch_local(2, what_a_worker_sees, (names,), "127.0.0.1", 0)
    for rank, (environ, threads, cwd, path) in seen.items():
        assert environ == {
            "MEGATRON_EXT_TEST_EARLIER": None,
            "MEGATRON_EXT_TEST_LATER": "set after it",
            "RANK": str(rank),
            "OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"],  # set by launch_local if unset
        }
        assert threads == int(os.environ["OMP_NUM_THREADS"])
        assert (cwd, path) == (str(tmp_path), sys.path)
