"""A sweep planned for several devices (TP blocks of the world): packs keep the run's TP, their
DP divides every job's micro-batches per step (the runtime deals them over the DP ranks), and a
plan's device is the block of ranks megatron's TP groups hold."""

from __future__ import annotations

import pytest

from test_lora_sweep import TINY

from megatron_ext.config import compose_config
from megatron_ext.lora.calibrate import save_fit
from megatron_ext.lora.costmodel import Fit, LinearCostModel
from megatron_ext.lora.groups import ranks_of
from megatron_ext.lora.sweep import jobs_of, plan_sweep
from megatron_ext.lora.workload import shapes_of

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


def test_a_device_is_a_block_of_tp_ranks():
    assert ranks_of((1, 3), 2) == (2, 3, 6, 7)
    assert ranks_of((2,), 1) == (2,)
