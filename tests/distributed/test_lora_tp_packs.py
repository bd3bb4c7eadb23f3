"""A sweep plan whose packs run at different TP degrees on two gloo ranks: a TP=1 pack on rank
0, then a TP=2 pack over both ranks, then a TP=1 pack on rank 1 (rank 0 goes from TP=1 to TP=2,
rank 1 from TP=2 to TP=1, each freeing its base for the next). Every job ends as when it trains
alone at TP=1: the same status, steps and tokens, losses and eval losses, and adapter in its
megatron checkpoint and PEFT export (gathered over its pack's TP group).

fp64 models: TP=2 sums the TP-split GEMMs, the LoRA reductions and the vocabulary's softmax in
another order than TP=1, so the two agree to rounding (measured: 1e-12 relative in the
adapters; in fp32, Adam's first step, which normalises every gradient, makes that 5e-4), not
bitwise. A pack reducing over the wrong TP group (parallel_state's TP=1 one, the other pack's),
a wrong shard or a base left over from another TP is off by O(1), or hangs (the worker has a
timeout).

Its worker runs in the two-rank launch of test_lora_concurrent and test_lora_dp (_lora_two_ranks.py).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_lora_concurrent import JOBS, outcome  # noqa: E402
from test_lora_sweep import TINY  # noqa: E402

from megatron_ext.lora.planning.plan import Pack, Plan  # noqa: E402

PLANS = {
    # rank 0 goes from TP=1 to TP=2, rank 1 from TP=2 to TP=1
    "mixed": Plan("test", (
        Pack(("a",), 1, 1, 1, (0,)),
        Pack(("c", "d"), 2, 1, 2, (0, 1)),
        Pack(("b",), 1, 1, 1, (1,)),
    )),
    # the reference: every job alone at TP=1
    "alone": Plan("test", tuple(Pack((j.name,), 1, 1, 1, (i % 2,)) for i, j in enumerate(JOBS))),
}
REL_TOL = 1e-9


def worker(out: str) -> None:
    import torch.distributed as dist

    from megatron_ext.config import compose_config
    from megatron_ext.lora.runtime.batching import SyntheticData
    from megatron_ext.lora.runtime.execute import execute
    from megatron_ext.models.convert.world import model_parallel_world

    cfg = compose_config([*TINY, "parallel.tp=2"])
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=257))
    with model_parallel_world(tp=1):
        for name, plan in PLANS.items():
            run_cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, output_dir=f"{out}/{name}"))
            results = execute(run_cfg, JOBS, plan, lambda job: SyntheticData(job, 257), dtype=torch.float64)
            if dist.get_rank() == 0:
                (Path(out) / f"{name}.json").write_text(json.dumps({n: dataclasses.asdict(r) for n, r in results.items()}))


def relative(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x - y).abs().max() / y.abs().max().clamp(min=1e-12)).item()


@pytest.mark.distributed
def test_packs_at_tp2_and_tp1_equal_each_job_alone_at_tp1(tmp_path_factory):
    from _lora_two_ranks import outputs  # the launch test_lora_concurrent and test_lora_dp share

    from megatron_ext.models.convert.world import model_parallel_world

    out = outputs(tmp_path_factory) / "tp_packs"
    with model_parallel_world():
        mixed, alone = outcome(out, "mixed"), outcome(out, "alone")
    assert mixed.keys() == alone.keys() == {j.name for j in JOBS}
    for job in JOBS:
        (results, weights, peft), (e_results, e_weights, e_peft) = mixed[job.name], alone[job.name]
        assert results["status"] == e_results["status"] == "done" and results["steps"] == e_results["steps"] == job.steps
        assert results["tokens"] == e_results["tokens"], job.name
        torch.testing.assert_close(results["losses"], e_results["losses"], rtol=REL_TOL, atol=0)
        torch.testing.assert_close(results["eval_losses"], e_results["eval_losses"], rtol=REL_TOL, atol=0)
        assert weights.keys() == e_weights.keys() and peft.keys() == e_peft.keys()
        assert any(b.abs().max() > 0 for _, b in e_weights.values()), f"{job.name} never trained"
        assert max(relative(weights[k][i], e_weights[k][i]) for k in weights for i in (0, 1)) <= REL_TOL, job.name
        assert max(relative(peft[k], e_peft[k]) for k in peft) <= REL_TOL, job.name
        tp = next(p.tp for p in PLANS["mixed"].packs if job.name in p.jobs)  # not TP=1 replicas
        assert f"TP {tp})" in (out / "mixed" / job.name / "log.txt").read_text(), job.name
