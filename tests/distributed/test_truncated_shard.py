"""A damaged checkpoint of a 2-worker run, resumed by 2 workers. A shard cut short or lost is
refused by the launcher's preflight from the checkpoint's metadata, before any worker starts;
damage only a reader finds (bytes overwritten, the size intact) is refused by the ranks. Each
ends with exit code 2 and the one line naming checkpoint.load and the path (the ranks' refusal
with a line saying which rank), never a traceback or torch's launcher report."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_ext.checkpointing import torch_dist as ckpt

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "experiment=none", "launcher.nproc=2", "train.iters=1", "train.eval_interval=0", "logging.progress_bar=false",
    "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.seq_length=32",
    "train.micro_batch_size=2", "train.global_batch_size=4",
]
# What torch's elastic agent logs (at LOGLEVEL=INFO) when it starts the workers.
WORKERS_START = "Starting worker group"


def train(*overrides: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE" and not k.startswith("SLURM_")}
    environ.update(PYTHONPATH=str(REPO), **env)
    command = [sys.executable, "-m", "megatron_ext.train", *TINY, f"data.cache_dir={cwd / 'cache'}", *overrides]
    return subprocess.run(command, cwd=cwd, env=environ, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """The checkpoint of one step of a 2-worker run (whose workers' start is logged)."""
    work = tmp_path_factory.mktemp("saved")
    done = train(f"checkpoint.save={work / 'ckpt'}", cwd=work, LOGLEVEL="INFO")
    assert done.returncode == 0 and WORKERS_START in done.stderr, done.stderr[-3000:]
    return work


def damaged_copy(saved: Path, tmp_path: Path, damage) -> tuple[Path, Path]:
    """A copy of the saved checkpoint with `damage` done to its largest shard: (root, shard)."""
    root = tmp_path / "ckpt"
    shutil.copytree(saved / "ckpt", root)
    shard = max(ckpt.iteration_dir(root, 1).glob("*.distcp"), key=lambda p: p.stat().st_size)
    damage(shard)
    return root, shard


def cut_3_bytes(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-3])


def zero_the_end(path: Path) -> None:
    """Overwrite the last item's zip directory: the size stays, the item cannot be read."""
    data = bytearray(path.read_bytes())
    data[-64:] = bytes(64)
    path.write_bytes(bytes(data))


# name: (damage, what the line says after "shard <path> ", given the whole file's size)
PREFLIGHT_CASES = {
    "cut short by 3 bytes": (cut_3_bytes, lambda size: f"is cut short: {size - 3} bytes, the checkpoint's metadata needs {size}"),
    "deleted": (Path.unlink, lambda size: f"is missing (the checkpoint's metadata needs {size} bytes there)"),
}


@pytest.mark.parametrize(
    "damage, says",
    [
        pytest.param(*case, id=name, marks=[pytest.mark.slow] if name == "deleted" else [])
        for name, case in PREFLIGHT_CASES.items()
    ],
)
def test_a_cut_or_lost_shard_is_refused_before_workers_start(saved, tmp_path, damage, says):
    size = max(p.stat().st_size for p in ckpt.iteration_dir(saved / "ckpt", 1).glob("*.distcp"))
    root, shard = damaged_copy(saved, tmp_path, damage)
    start = time.monotonic()
    done = train(f"checkpoint.load={root}", "train.iters=2", cwd=tmp_path, LOGLEVEL="INFO")
    print(f"refused after {time.monotonic() - start:.1f} s")
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.splitlines() == [f"error: checkpoint.load: shard {shard} {says(size)}"], done.stderr[-3000:]
    assert done.stdout == "" and WORKERS_START not in done.stderr


def test_a_shard_the_ranks_cannot_read_is_one_line(saved, tmp_path):
    root, _ = damaged_copy(saved, tmp_path, zero_the_end)
    done = train(f"checkpoint.load={root}", "train.iters=2", cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = (done.stdout + done.stderr).splitlines()
    assert len(lines) == 2, lines
    assert lines[0] == "launcher: rank 0 refused its input; the workers stopped"
    assert lines[1].startswith(f"error: checkpoint.load: {ckpt.iteration_dir(root, 1)} cannot be loaded: "), lines


@pytest.mark.slow  # the same refusal as above, with restarts allowed
def test_a_refusal_is_not_restarted(saved, tmp_path):
    root, _ = damaged_copy(saved, tmp_path, zero_the_end)
    done = train(f"checkpoint.load={root}", "train.iters=2", "launcher.max_restarts=2", cwd=tmp_path, LOGLEVEL="INFO")
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.count(WORKERS_START) == 1, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1].startswith(f"error: checkpoint.load: {ckpt.iteration_dir(root, 1)} cannot be loaded: ")
