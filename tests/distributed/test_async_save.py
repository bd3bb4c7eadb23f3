"""Async checkpoint saves (dist_checkpointing's async request, written by a background process
while training goes on): resuming from one is bitwise the same as resuming from a sync save. A
background write cut off mid-way: tests/faults/test_crash_faults.py."""

from __future__ import annotations

import pytest
import torch
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron_ext.train import run_from_overrides
from megatron_ext.checkpointing import torch_dist as ckpt
from tests.faults._runs import SAVES_TWICE

pytestmark = pytest.mark.distributed



def _tensors(checkpoint_dir, out) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(str(checkpoint_dir), str(out))
    return {k: v for k, v in torch.load(out, weights_only=False).items() if torch.is_tensor(v)}


# name -> (layout overrides, workers)
LAYOUTS = {
    "one_rank": pytest.param(([], 1), id="one_rank"),
    # Finalisation is collective: every rank's write done before rank 0 publishes (30 s).
    "tp2": pytest.param((["parallel.tp=2"], 2), id="tp2", marks=pytest.mark.slow),
}


@pytest.mark.parametrize("layout", LAYOUTS.values())
def test_async_save_resumes_bitwise_like_sync_save(tmp_path, monkeypatch, layout):
    overrides, workers = layout
    scheduled = []  # seen in this process: the one-rank run's
    real_schedule = AsyncCallsQueue.schedule_async_request
    monkeypatch.setattr(
        AsyncCallsQueue, "schedule_async_request", lambda q, r: scheduled.append(r) or real_schedule(q, r)
    )
    common = [*SAVES_TWICE, *overrides, f"launcher.nproc={workers}", f"data.cache_dir={tmp_path / 'cache'}"]
    roots = {"sync": tmp_path / "sync", "async": tmp_path / "async"}
    losses = {
        kind: run_from_overrides([*common, f"checkpoint.save={root}", f"checkpoint.async_save={kind == 'async'}"])["losses"]
        for kind, root in roots.items()
    }
    assert losses["async"] == losses["sync"]
    assert len(scheduled) == (2 if workers == 1 else 0)  # iterations 3 and 6, in the background
    for root in roots.values():
        assert ckpt.latest_iteration(root) == 6 and not list(root.glob(".iter_*.tmp"))

    # The iteration-3 save was written while steps 4-6 changed the weights.
    sync3, async3 = (_tensors(ckpt.iteration_dir(r, 3), tmp_path / f"{k}.pt") for k, r in roots.items())
    assert sync3.keys() == async3.keys()
    assert all(torch.equal(sync3[k], async3[k]) for k in sync3)
    resumed = {
        kind: run_from_overrides([*common, f"checkpoint.load={root}", "checkpoint.step=3"])["losses"]
        for kind, root in roots.items()
    }
    assert resumed["async"] == resumed["sync"] == losses["sync"][3:]
