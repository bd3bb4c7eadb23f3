"""A short training run in a fresh process that loads an outside plugin package of tests/plugins/
as a user's is loaded: named in MEGATRON_EXT_PLUGINS."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = ["experiment=none", "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
        "model.num_attention_heads=4", "model.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=2",
        "train.eval_interval=0", "logging.progress_bar=false", "launcher.device=cpu"]


def train_with_plugin(module: str, tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`python -m megatron_ext.train` of the tiny model with `overrides`, plugin module `module` loaded."""
    env = {**os.environ, "MEGATRON_EXT_PLUGINS": module, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "megatron_ext.train", *TINY, f"data.cache_dir={tmp_path / 'cache'}", *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
