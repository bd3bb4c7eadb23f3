"""A checkpoint shard cut short (an interrupted copy) is found by the workers that read it: the
run ends with their one line naming the checkpoint folder and exit code 2, not with each
worker's traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.training import checkpoint as ckpt

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # two 2-worker launches, ~40 s

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "experiment=none", "launcher.nproc=2", "train.iters=1", "train.eval_interval=0", "logging.progress_bar=false",
    "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.seq_length=32",
    "train.micro_batch_size=2", "train.global_batch_size=4",
]


def train(*overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE" and not k.startswith("SLURM_")}
    env["PYTHONPATH"] = str(REPO)
    command = [sys.executable, "-m", "megatron_ext.train", *TINY, f"data.cache_dir={cwd / 'cache'}", *overrides]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_a_truncated_shard_is_one_line(tmp_path):
    root = tmp_path / "ckpt"
    assert train(f"checkpoint.save={root}", cwd=tmp_path).returncode == 0
    folder = ckpt.iteration_dir(root, 1)
    shard = max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    done = train(f"checkpoint.load={root}", "train.iters=2", cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith(f"error: checkpoint.load: {folder} cannot be loaded: ")
