"""dpp across processes: data-parallel replicas that plan ahead still agree, and a resumed run
or a run resharded live trains on exactly the batches of an uninterrupted one.

`agreement` (2 gloo ranks, DP=2, no model): each replica plans its share of the same global
batches in the background; the plans equal the ones it makes at each step, the shares partition
every batch, and a replica that reads other batches (another seed) or cannot plan (a budget too
small on it alone) makes every replica raise at that step instead of training on or hanging.

`resume` (slow, the trainer on 2 ranks, PP=2): a run that checkpoints at step 3 and resumes has
the losses of an uninterrupted run at steps 4-6, bit for bit.

`reshard` (slow, the trainer with the reshard plugin): a run moved live from PP=2 to DP=2, or
onto two more workers of a pool, has the losses of the run that stays at PP=2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.distributed

SEED, BATCHES, DOCS = 3, 4, 6
DOC_LENGTHS = np.minimum(np.maximum(2, np.rint(np.random.default_rng(5).lognormal(4.0, 1.2, 40))), 600).astype(int).tolist()


def cost_model():
    from megatron_ext.dpp.planning.costmodel import CostModel

    return CostModel(alpha=2e-5, beta=2e-8, gamma=1e-4, act_bytes_token=6000, ckpt_bytes_token=300, kv_bytes_token=512,
                     head_bytes_token=1500, state_bytes_param=16, layer_params=50000, num_layers=4)


def build_dataset(prefix: str) -> None:
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(1000))
    rng = np.random.default_rng(0)
    for n in DOC_LENGTHS:
        builder.add_document(rng.integers(0, 1000, n), [n])
    builder.finalize(prefix + ".idx")


def planned_stream(prefix: str, seed: int, budget_mb: float, ahead: bool) -> list:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_ext.dpp.plugin import DppConfig, DppPlugin, StepPlanner

    cfg = DppConfig(max_seq_len=256, docs_per_batch=DOCS, memory_budget_mb=budget_mb, plan_ahead=ahead)
    plugin = DppPlugin(cfg)
    stream = plugin.plan_stream(IndexedDataset(prefix), seed, StepPlanner(cfg, 4, 1, cost_model()))
    try:
        return [(p.plan, [len(d) - 1 for d in p.documents]) for p in (next(stream) for _ in range(BATCHES))]
    finally:
        stream.close()


def worker(out: str, prefix: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_ext.platform.launch import join_world

    join_world("cpu")
    parallel_state.initialize_model_parallel()
    rank = dist.get_rank()
    report = {"ahead": planned_stream(prefix, SEED, 64, True), "at_step": planned_stream(prefix, SEED, 64, False)}
    report = {"same": report["ahead"] == report["at_step"], "shares": [lengths for _, lengths in report["ahead"]]}
    for case, seed, budget in (("other_seed", SEED + rank, 64), ("budget", SEED, 64 if rank == 0 else 0.5)):
        try:
            planned_stream(prefix, seed, budget, True)
            report[case] = None
        except (RuntimeError, ValueError) as raised:
            report[case] = f"{type(raised).__name__}: {raised}"
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])


def test_replicas_planning_ahead_agree_and_fail_together(tmp_path):
    from _torchrun import rank_reports, torchrun

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_ext.dpp.runtime.batch import DocumentBatches

    prefix = str(tmp_path / "docs")
    build_dataset(prefix)
    torchrun(__file__, 2, str(tmp_path), prefix)
    reports = rank_reports(tmp_path, 2)
    batches = DocumentBatches(IndexedDataset(prefix), DOCS, 256, seed=SEED)
    for b, batch in zip(range(BATCHES), batches):
        shares = [r["shares"][b] for r in reports]
        assert sorted(shares[0] + shares[1]) == sorted(len(d) - 1 for d in batch)
    for r in reports:
        assert r["same"]
        assert r["other_seed"].startswith("RuntimeError: dpp: data-parallel replicas read different global batches")
        assert r["budget"].startswith("ValueError: dpp: memory budget") and "minimum feasible budget" in r["budget"]


@pytest.mark.slow
def test_a_resumed_run_has_the_losses_of_an_uninterrupted_run(tmp_path):
    from megatron_ext.train import run_from_overrides

    cost_model().to_json(tmp_path / "cost.json")
    common = [
        "experiment=none", "plugins=[dpp]", "parallel.pp=2", "launcher.nproc=2", "train.eval_interval=0",
        "logging.progress_bar=false", "model.seq_length=64", f"data.cache_dir={tmp_path / 'cache'}",
        f"dpp.cost_model={tmp_path / 'cost.json'}", "dpp.max_seq_len=256", f"dpp.docs_per_batch={DOCS}",
        "dpp.memory_budget_mb=64", "train.iters=6",
    ]
    whole = run_from_overrides([*common, f"checkpoint.save={tmp_path / 'whole'}"])
    run_from_overrides([*common, "train.exit_interval=3", f"checkpoint.save={tmp_path / 'ckpt'}"])
    resumed = run_from_overrides([*common, f"checkpoint.save={tmp_path / 'ckpt'}", f"checkpoint.load={tmp_path / 'ckpt'}"])
    assert resumed["losses"] == whole["losses"][3:]
    # The documents truncated over the whole run are counted across the restart too.
    assert resumed["notes"][-2] == whole["notes"][-2]


# name -> (overrides, the move, what its report says): a move within the job's processes, and
# one that brings two standby workers of a pool in (they read the plan stream's position from
# the running workers' state)
MOVES = {
    "in_process": (["launcher.nproc=2"], "{step: 3, layout: {pp: 1, dp: 2}}", "tp1·pp2·dp1 -> tp1·pp1·dp2"),
    "worker_pool": (["launcher.nproc=4", "parallel.dp=1"], "{step: 3, layout: {pp: 2, dp: 2}}",
                    "tp1·pp2·dp1·+2 standby -> tp1·pp2·dp2"),
}


@pytest.fixture(scope="module")
def reshard_runs(tmp_path_factory):
    """`run(overrides)`: a 5-step DPP run from PP=2 on 2 workers, with `overrides`; the run
    without any (it stays at PP=2) is made once."""
    from megatron_ext.train import run_from_overrides

    root = tmp_path_factory.mktemp("dpp_reshard")
    cost_model().to_json(root / "cost.json")
    common = [
        "experiment=none", "parallel.pp=2", "train.eval_interval=0", "logging.progress_bar=false",
        "model.seq_length=64", f"data.cache_dir={root / 'cache'}", f"dpp.cost_model={root / 'cost.json'}",
        "dpp.max_seq_len=256", f"dpp.docs_per_batch={DOCS}", "dpp.memory_budget_mb=64", "train.iters=5",
    ]
    runs = {}

    def run(*overrides: str) -> dict:
        if overrides not in runs:
            runs[overrides] = run_from_overrides([*common, *overrides])
        return runs[overrides]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("move", MOVES)
def test_a_run_resharded_live_has_the_losses_of_a_run_that_stays_on_its_layout(reshard_runs, move):
    """After a live move the DPP plugin plans again for the new layout from the first batch
    not yet trained; every step equals the one-process step on its batch, so the losses are
    those of the run that stays at PP=2 (up to the reductions' order)."""
    overrides, schedule, report = MOVES[move]
    stays = reshard_runs("plugins=[dpp]", "launcher.nproc=2")
    moved = reshard_runs("plugins=[reshard,dpp]", *overrides, f"reshard.schedule=[{schedule}]")
    assert any(report in note for note in moved["notes"])
    assert any(note.endswith("(first batch on the new layout)") for note in moved["notes"])  # planned again
    assert moved["losses"] == pytest.approx(stays["losses"], rel=1e-5)
    assert moved["notes"][-1].split(" tokens")[0] == stays["notes"][-1].split(" tokens")[0]  # the same documents trained


def test_a_requested_move_to_a_layout_dpp_cannot_train_is_refused_and_training_goes_on(reshard_runs, tmp_path):
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"layout": {"pp": 1, "cp": 2}}))
    run = reshard_runs("plugins=[reshard,dpp]", "launcher.nproc=2", f"reshard.request_file={request}")
    refused = [note for note in run["notes"] if "reshard request refused" in note]
    assert len(refused) == 1 and "parallel.cp: dpp does not support context parallelism" in refused[0], run["notes"]
    assert len(run["losses"]) == 5  # every step trained, on the layout it started on
