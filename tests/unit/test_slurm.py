"""SLURM: rendered sbatch templates parse and launch the right command lines; the Hydra
submitit launcher config composes."""

from __future__ import annotations

import importlib.util
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.config import store

REPO = Path(__file__).resolve().parents[2]
SLURM_DIR = REPO / "scripts" / "slurm"

_spec = importlib.util.spec_from_file_location("slurm_render", SLURM_DIR / "render.py")
render_module = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = render_module  # dataclasses look their module up there
_spec.loader.exec_module(render_module)
Job, render, template_path = render_module.Job, render_module.render, render_module.template_path

TEMPLATES = ["train_multinode", "train_srun"]
# Overrides a shell would mangle if they were not quoted: spaces, `$`, quotes, a glob.
AWKWARD = [
    "parallel.tp=4",
    "checkpoint.save=/scratch/my run",
    "logging.wandb_project=$HOME",
    "data.split='9,1'",
    "x=*",
]
EXTRA = "train.iters=7"  # given to `sbatch job.sbatch` after the script name

SLURM_ENV = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "node[01-02]",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS": "16",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
}

REPORT = """
report() {
    echo "PROGRAM=$1"; shift
    for var in MASTER_ADDR MASTER_PORT RANK LOCAL_RANK WORLD_SIZE OMP_NUM_THREADS \\
               CUDA_DEVICE_MAX_CONNECTIONS TORCH_NCCL_AVOID_RECORD_STREAMS; do
        echo "$var=${!var-}"
    done
    echo "SIGNALS_IGNORED=$(awk '/^SigIgn:/ {print $2}' /proc/$$/status)"
    for arg in "$@"; do echo "ARG=$arg"; done
}
"""
# Stand-ins for the cluster: scontrol expands the node list, srun runs its command once (as the
# task whose SLURM_* variables the test sets), torchrun and python report what they were given.
FAKES = {
    "scontrol": 'printf "node01\\nnode02\\n"',
    "srun": 'while [[ "$1" == -* ]]; do shift; done\nexec "$@"',
    "torchrun": REPORT + 'report torchrun "$@"',
    "python": REPORT + 'report python "$@"',
}


def rendered(name: str, **values) -> str:
    return render(template_path(name).read_text(), Job(**values))


def run_job(tmp_path: Path, script: str) -> tuple[dict[str, str], list[str]]:
    """Run a rendered sbatch script as the batch step would, with fake Slurm tools."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, body in FAKES.items():
        path = bin_dir / tool
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    job = tmp_path / "job.sbatch"
    job.write_text(script)
    unset = ("MASTER_PORT", "OMP_NUM_THREADS", "RANK", "WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(SLURM_ENV, PATH=f"{bin_dir}:{env['PATH']}")
    out = subprocess.run(
        ["bash", str(job), EXTRA], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    values = dict(line.split("=", 1) for line in lines if not line.startswith("ARG="))
    return values, [line[len("ARG="):] for line in lines if line.startswith("ARG=")]


@pytest.mark.parametrize("name", TEMPLATES)
def test_rendered_template_parses(tmp_path, name):
    script = rendered(
        name, nodes=2, gpus_per_node=4, partition="gpu", account="proj", overrides=AWKWARD
    )
    (tmp_path / "job.sbatch").write_text(script)
    subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")], check=True)
    assert "${" + "nodes}" not in script
    directives = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --nodes=2" in directives
    assert "#SBATCH --gpus-per-node=4" in directives
    assert "#SBATCH --signal=USR1@90" in directives
    assert directives[-2:] == ["#SBATCH --partition=gpu", "#SBATCH --account=proj"]


def test_multinode_runs_torchrun_per_node(tmp_path):
    script = rendered(
        "train_multinode", nodes=2, gpus_per_node=4, cpus_per_gpu=6, overrides=AWKWARD
    )
    assert "#SBATCH --ntasks-per-node=1" in script
    assert "#SBATCH --cpus-per-task=24" in script
    env, args = run_job(tmp_path, script)
    assert env["PROGRAM"] == "torchrun"
    assert args == [
        "--signals-to-handle", "SIGHUP,SIGQUIT", "--nnodes", "2", "--nproc-per-node", "4", "--rdzv-id", "4242",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "node01:29500",
        "-m", "megatron_ext.train", "hydra.run.dir=outputs/slurm-4242", *AWKWARD, EXTRA,
    ]
    assert env["OMP_NUM_THREADS"] == "6"
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert env["TORCH_NCCL_AVOID_RECORD_STREAMS"] == "1"
    # SLURM signals the workers themselves; torchrun must neither re-send nor die of it.
    ignored = int(env["SIGNALS_IGNORED"], 16)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        assert ignored >> (sig - 1) & 1, f"torchrun does not ignore {sig.name}"


def test_srun_task_derives_torch_env_from_slurm(tmp_path):
    script = rendered("train_srun", nodes=2, gpus_per_node=8, overrides=AWKWARD)
    assert "#SBATCH --ntasks-per-node=8" in script
    env, args = run_job(tmp_path, script)
    assert env["PROGRAM"] == "python"
    assert args == ["-m", "megatron_ext.train", "hydra.run.dir=outputs/slurm-4242", *AWKWARD, EXTRA]
    assert env["MASTER_ADDR"] == "node01"
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("3", "1", "16")
    # The same port megatron_ext.platform.launch derives when MASTER_PORT is unset.
    assert env["MASTER_PORT"] == str(15000 + 4242 % 20000)


@pytest.mark.parametrize(
    "values, phrase",
    [
        ({"nodes": 0}, "nodes must be a positive integer"),
        ({"time": "1h"}, "time must look like"),
        ({"partition": "gpu\n#SBATCH --exclusive"}, "partition may hold"),
    ],
    ids=["nodes", "time", "partition_injection"],
)
def test_bad_values_are_refused(values, phrase):
    with pytest.raises(ValueError, match=phrase):
        rendered("train_srun", **values)


def test_unknown_placeholder_is_refused():
    with pytest.raises(ValueError, match=r"unknown placeholder \$\{gpus\}"):
        render("#SBATCH --gpus=${gpus}\necho $HOME ${HOME}\n", Job())


def test_cli_dry_run_prints_and_writes_nothing(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SLURM_DIR / "render.py"), "train_srun", "--nodes", "3",
         "parallel.tp=2", "--dry-run"],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    )
    assert "#SBATCH --nodes=3" in out.stdout
    assert '"hydra.run.dir=outputs/slurm-$SLURM_JOB_ID" parallel.tp=2 "$@"' in out.stdout
    assert list(tmp_path.iterdir()) == []


def test_hydra_slurm_launcher_composes():
    from hydra import compose, initialize_config_dir

    store.register_configs()
    with initialize_config_dir(config_dir=str(store.CONFIG_DIR), version_base="1.3"):
        cfg = compose(
            config_name="train",
            overrides=["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=4"],
            return_hydra_config=True,
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_ == (
        "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    )
    assert (launcher.nodes, launcher.gpus_per_node, launcher.tasks_per_node) == (1, 4, 4)
    assert (launcher.timeout_min, launcher.signal_delay_s) == (240, 90)
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in launcher.setup
    assert f"export OMP_NUM_THREADS={launcher.cpus_per_task}" in launcher.setup
    assert any(line.startswith("export MASTER_PORT=") for line in launcher.setup)
