"""A checkpoint save that fills the disk (a real one: a tmpfs of one and a half checkpoints)
ends the run with one line naming the staging folder and the space left, exit code 2, and the
checkpoint before it stays the latest and loads."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from megatron_ext.checkpointing import torch_dist as ckpt

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # two 2-worker launches, ~160 s on 2 busy cores

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "experiment=none", "launcher.nproc=2", "train.eval_interval=0", "logging.progress_bar=false",
    "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.seq_length=32",
    "train.micro_batch_size=2", "train.global_batch_size=4",
]
CHECKPOINT_BYTES = 1_887_565  # one checkpoint of TINY (du -sb)


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs that holds one checkpoint of TINY but not two (needs root: skipped otherwise)."""
    mount = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={CHECKPOINT_BYTES * 3 // 2}", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def train(*overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE" and not k.startswith("SLURM_")}
    env["PYTHONPATH"] = str(REPO)
    command = [sys.executable, "-m", "megatron_ext.train", *TINY, f"data.cache_dir={cwd / 'cache'}", *overrides]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_a_save_that_fills_the_disk_is_one_line_and_keeps_the_last_checkpoint(small_disk, tmp_path):
    root = small_disk / "ckpt"
    done = train("train.iters=4", f"checkpoint.save={root}", "checkpoint.interval=2", cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    staging = root / f".{ckpt.iteration_dir(root, 4).name}.tmp"
    assert re.fullmatch(
        rf"error: checkpoint\.save: {re.escape(str(staging))}: no space left on its filesystem "
        rf"\(\d+(\.\d)? (B|KiB) free of 2\.7 MiB\); {re.escape(str(ckpt.iteration_dir(root, 2)))} stays the latest",
        last,
    ), last
    assert ckpt.latest_iteration(root) == 2
    resumed = train("train.iters=3", f"checkpoint.load={root}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "| tokens 128 |" in resumed.stdout  # one step of 4 x 32 tokens: resumed at iteration 2
