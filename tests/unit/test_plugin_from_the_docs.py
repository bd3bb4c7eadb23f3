"""A plugin outside megatron_ext (tests/plugins/grad_norm/, written from the plugin docs alone)
runs with an unchanged megatron_ext, named by MEGATRON_EXT_PLUGINS: its section composes, its
check refuses bad input, and its per-layer gradient norms add up to megatron's own grad norm of
the step (computed by megatron's optimizer, independently)."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

from tests.unit._outside_plugin_runs import train_with_plugin


def train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return train_with_plugin("tests.plugins.grad_norm", tmp_path, "launcher.nproc=1", *overrides)


def test_a_plugin_of_its_own_folder_logs_per_layer_grad_norms(tmp_path):
    log = tmp_path / "norms.jsonl"
    # No clipping: megatron clips the gradients in place, after measuring their norm.
    done = train(tmp_path, "plugins=[grad_norm]", "grad_norm.every=2", f"grad_norm.file={log}", "train.iters=4",
                 "optim.clip_grad=0")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4]
    for row in rows:
        assert set(row["layers"]) == {"layer 0", "layer 1", "other"}
        assert math.isclose(row["total"], row["megatron"], rel_tol=1e-5), row
    assert "step 4: grad norm" in done.stdout + done.stderr


def test_its_check_refuses_bad_input_before_launch(tmp_path):
    done = train(tmp_path, "plugins=[grad_norm]", "grad_norm.every=0")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == "error: grad_norm.every: must be at least 1, got 0"
