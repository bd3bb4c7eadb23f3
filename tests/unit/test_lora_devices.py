"""A sweep planned for several devices (ranks): at parallel.tp=1 every pack is TP=1, its DP
divides every job's micro-batches per step (the runtime deals them over the DP ranks), and a
pack's TP groups are runs of consecutive ranks among its own, its DP groups the ranks at one TP
position."""

from __future__ import annotations

import dataclasses

import pytest

from test_lora_sweep import TINY

from megatron_ext.config import compose_config
from megatron_ext.lora.calibrate import save_fit
from megatron_ext.lora.planning.costmodel import Fit, LinearCostModel
from megatron_ext.lora.planning.memory import BF16, FP32, MemoryModel
from megatron_ext.lora.planning.plan import Pack
from megatron_ext.lora.planning.workload import shapes_of
from megatron_ext.lora.runtime.groups import dp_ranks, tp_ranks
from megatron_ext.lora.sweep import jobs_of, plan_sweep

JOBS = "[{name: a, rank: 4}, {name: b, rank: 8}, {name: c, rank: 16, steps: 1}, {name: d, rank: 2, steps: 4}]"


def planned(devices: int, *overrides: str, jobs: str = JOBS):
    cfg = compose_config([*TINY, "model.vocab_size=257", f"lora.jobs={jobs}", *overrides])
    sweep_jobs = jobs_of(cfg)
    return plan_sweep(cfg, sweep_jobs, devices).plan, sweep_jobs


@pytest.mark.parametrize("devices", [2, 4])
def test_packs_spread_over_the_devices_with_a_dp_the_jobs_divide(devices):
    plan, jobs = planned(devices)
    plan.check([j.name for j in jobs], devices)
    by_name = {j.name: j for j in jobs}
    assert all(p.tp == 1 and all(by_name[n].accumulation_steps % p.dp == 0 for n in p.jobs) for p in plan.packs)
    used = [d for p in plan.packs for d in p.devices]
    assert len(set(used)) > 1, f"the plan leaves devices idle: {plan}"


def test_dp_is_chosen_only_where_every_job_divides_it(tmp_path):
    gemm_only = save_fit(tmp_path / "fit.json", Fit(LinearCostModel(shapes_of(compose_config([*TINY, "model.vocab_size=257"]).model), (0, 0, 1.0, 0, 0, 0)), 0, 0, 0), 1)
    two = "[{name: a, rank: 4, steps: 8}, {name: b, rank: 8, steps: 8}]"
    plan, _ = planned(4, f"lora.cost_model={gemm_only}", jobs=two)
    assert max(p.dp for p in plan.packs) > 1, f"data parallelism should pay when the cost is all GEMM: {plan}"
    plan, _ = planned(4, f"lora.cost_model={gemm_only}", "train.global_batch_size=3", jobs=two)
    assert {p.dp for p in plan.packs} == {1}, plan


def test_user_slots_make_one_pack_over_the_devices_the_jobs_divide():
    plan, _ = planned(4, "lora.slots=2")
    (pack,) = plan.packs
    assert (pack.slots, pack.dp, pack.devices) == (2, 2, (0, 1))


def test_a_packs_tp_groups_are_consecutive_ranks_of_its_own():
    pack = Pack(("a",), 2, 2, 1, (7, 2, 3, 6))
    assert tp_ranks(pack) == [(2, 3), (6, 7)]
    assert dp_ranks(pack) == [(2, 6), (3, 7)]
    assert tp_ranks(Pack(("a",), 1, 1, 1, (2,))) == dp_ranks(Pack(("a",), 1, 1, 1, (2,))) == [(2,)]


def test_a_pack_runs_at_tp2_where_only_that_fits_in_memory():
    """parallel.tp=2 is the largest TP a pack may use: with memory for the largest job at TP=2
    but not at TP=1, every pack holding it is TP=2 on two ranks."""
    cfg = compose_config([*TINY, "model.vocab_size=257", "parallel.tp=2", f"lora.jobs={JOBS}"])
    jobs = jobs_of(cfg)
    memory = MemoryModel(shapes_of(cfg.model), FP32 if cfg.model.precision == "fp32" else BF16, fused_attention=False)
    tp1, tp2 = ({j.name: memory.per_device([j], tp, 1).total for j in jobs} for tp in (1, 2))
    budget = (max(tp1.values()) + max(tp2.values())) / 2
    needs_tp2 = {name for name, need in tp1.items() if need > budget}
    assert needs_tp2 and max(tp2.values()) < budget
    cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, memory_gb=budget / 2**30))
    plan = plan_sweep(cfg, jobs, 2).plan
    plan.check([j.name for j in jobs], 2)
    assert all((p.tp, p.devices) == (2, (0, 1)) for p in plan.packs if needs_tp2 & set(p.jobs)), plan
    at_tp1 = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp=1))
    with pytest.raises(ValueError, match="cannot fit in memory"):
        plan_sweep(at_tp1, jobs, 2)


@pytest.mark.parametrize(
    "tp,devices,message",
    [
        (2, 3, r"parallel.tp=2 \(the largest TP a pack may use\) does not divide the world of 3 rank"),
        (8, 8, r"parallel.tp=8 .* does not split the model evenly \(attention heads 4"),
        (3, 3, r"parallel.tp=3 .* is not a power of two"),
    ],
    ids=["world", "heads", "power-of-two"],
)
def test_a_largest_tp_the_planner_cannot_use_is_refused(tp, devices, message):
    with pytest.raises(ValueError, match=message):
        planned(devices, f"parallel.tp={tp}")
