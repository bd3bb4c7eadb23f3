"""Packed LoRA training at TP=2 (two gloo ranks) gives every adapter the weights it gets at
TP=1: the column-parallel (A replicated, B split by rows, the fc1 gate/up halves split each) and
row-parallel (A split by columns, B replicated) layouts, their collectives, per-job clipping on
the TP-summed norm, and dropout masks drawn over the logical input.

The models are fp64, and so is the loss (the packed runtime's, lora/runtime/loss.py; megatron's own
cross entropy computed in fp32 whatever the logits' dtype); TP=2 sums the GEMMs and the
vocabulary in another order, so the two runs agree to fp64 rounding, not bitwise. A wrong shard
or a missing reduction is off by O(1).

This file is also the worker script torchrun starts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_lora_packed import JOBS, max_diff, train  # noqa: E402


REL_TOL = 1e-9


def worker(out: str) -> None:
    import torch.distributed as dist

    from megatron_ext.models.convert.world import model_parallel_world

    with model_parallel_world(tp=2):
        weights, results, before, after = train(JOBS, capacity=2, dtype=torch.float64)
        assert all(torch.equal(before[k], after[k]) for k in before)
        if dist.get_rank() == 0:
            torch.save({"weights": weights, "status": {n: r.status for n, r in results.items()}}, Path(out) / "tp2.pt")


if __name__ == "__main__":
    worker(*sys.argv[1:])


@pytest.mark.slow  # two torchrun workers importing megatron: about 30-100 s on the shared 2 cores
@pytest.mark.distributed
def test_tp2_equals_tp1_for_every_adapter(one_rank_world, tmp_path):
    from _torchrun import torchrun

    torchrun(__file__, 2, str(tmp_path), timeout=300)
    tp2 = torch.load(tmp_path / "tp2.pt")
    tp1, results, _, _ = train(JOBS, capacity=2, dtype=torch.float64)
    for job in JOBS:
        assert tp2["status"][job.name] == results[job.name].status == "done"
        scale = max(w.abs().max().item() for pair in tp1[job.name].values() for w in pair)
        assert max_diff(tp2["weights"][job.name], tp1[job.name]) <= REL_TOL * scale, job.name
