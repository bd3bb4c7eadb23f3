"""`python -m megatron_ext.dpp.tools.calibrate --tp 2 [--sequence-parallel]` times each rank's shard
of the layer and the head in two processes and records the layout it was calibrated at: a
rank keeps half the K/V groups' bytes, and under sequence parallelism half of each token-wise
tensor's; a run at another tensor parallelism refuses the cost model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.distributed._torchrun import REPO

pytestmark = pytest.mark.distributed

GRID = ["--q", "32", "64", "128", "--prefix", "0", "64", "--repeats", "3", "--no-overhead"]


def calibrated(tmp_path, *layout: str) -> dict:
    out = tmp_path / f"cost{len(list(tmp_path.iterdir()))}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_ext.dpp.tools.calibrate", "--out", str(out), *GRID, *layout],
                   check=True, env=env, cwd=REPO, timeout=600)
    return {**json.loads(out.read_text()), "path": str(out)}


@pytest.mark.slow  # 25 s: two calibrations at TP2 (real layers are measured at TP1 in the default suite: test_dpp_costmodel.py)
def test_tensor_parallel_calibration_times_a_rank_shard_and_records_its_layout(tmp_path):
    from megatron_ext.config.schema import ParallelConfig
    from megatron_ext.config.store import MODEL_PRESETS
    from megatron_ext.dpp.config import check_calibrated_for

    one = calibrated(tmp_path)
    tp = calibrated(tmp_path, "--tp", "2")
    sp = calibrated(tmp_path, "--tp", "2", "--sequence-parallel")
    assert [(c["shape"]["tp"], c["shape"]["sequence_parallel"]) for c in (one, tp, sp)] == [(1, False), (2, False), (2, True)]
    for c in (one, tp, sp):
        assert all(s["fwd_s"] > 0 and s["bwd_s"] > 0 for s in c["samples"])
    kv = [c["cost_model"]["kv_bytes_token"] for c in (one, tp, sp)]
    assert kv == [kv[0], kv[0] / 2, kv[0] / 2]
    saved = [c["cost_model"]["act_bytes_token"] for c in (one, tp, sp)]
    assert saved[2] < saved[1] < saved[0]  # heads split over the ranks, then the token-wise tensors too
    check_calibrated_for(sp["path"], MODEL_PRESETS["llama_tiny"], ParallelConfig(tp=2, sequence_parallel=True))
    with pytest.raises(ValueError, match=r"tp 2 \(this run: 1\)"):
        check_calibrated_for(sp["path"], MODEL_PRESETS["llama_tiny"], ParallelConfig())
