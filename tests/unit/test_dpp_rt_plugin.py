"""The dpp plugin's planning step on one rank: a budget no plan meets is refused before any
step runs, naming a minimum budget that does admit a plan; bad config is refused early."""

from __future__ import annotations

import re

import pytest
import torch

from megatron_ext.dpp.costmodel import CostModel
from megatron_ext.dpp.plugin import DppConfig, DppPlugin, StepPlanner
from megatron_ext.dpp.simulate import memory_peaks

COST = CostModel(alpha=2e-5, beta=2e-8, gamma=1e-4, act_bytes_token=6000, ckpt_bytes_token=300, kv_bytes_token=512,
                 head_bytes_token=1500, state_bytes_param=16, layer_params=50000, num_layers=2)
BATCH = [torch.arange(301), torch.arange(41), torch.arange(91), torch.arange(13)]


def test_a_hopeless_budget_is_refused_with_a_feasible_minimum(one_rank_world):
    with pytest.raises(ValueError, match="minimum feasible budget") as refused:
        StepPlanner(DppConfig(memory_budget_mb=2.0), num_layers=2, pp=1, cost=COST).plan(BATCH)
    minimum = int(re.search(r"\((\d+) bytes\)", str(refused.value)).group(1))
    budget = minimum * 1.001
    planned = StepPlanner(DppConfig(memory_budget_mb=budget / 2**20), num_layers=2, pp=1, cost=COST).plan(BATCH)
    assert max(memory_peaks(planned.plan, COST, (2,))) <= budget
    assert [len(d) for d in planned.documents] == [301, 41, 91, 13]


@pytest.mark.parametrize(
    "field,value,message",
    [("too_long", "drop", "too_long"), ("policy", "fastest", "policy"), ("memory_budget_mb", 0.0, "memory_budget_mb")],
)
def test_bad_config_is_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        DppPlugin(DppConfig(**{field: value}))


@pytest.mark.parametrize("parallel,arch,message", [
    ({}, "hybrid", "model.arch=gpt"),
    ({"cp": 2}, "gpt", "parallel.cp"),
    ({"vpp": 2}, "gpt", "parallel.vpp"),
    ({"ep": 2}, "gpt", "parallel.ep"),
])
def test_unsupported_setups_are_refused(parallel, arch, message):
    from types import SimpleNamespace

    layout = SimpleNamespace(**{"vpp": None, "cp": 1, "tp": 1, "ep": 1, "sequence_parallel": False, **parallel})
    cfg = SimpleNamespace(parallel=layout, model=SimpleNamespace(arch=arch, num_experts=None))
    with pytest.raises(ValueError, match=message):
        DppPlugin().setup(SimpleNamespace(cfg=cfg))


@pytest.mark.parametrize("sequence_parallel,num_experts", [(False, None), (True, None), (True, 4)])
def test_tensor_parallelism_and_moe_are_accepted(sequence_parallel, num_experts):
    from types import SimpleNamespace

    layout = SimpleNamespace(vpp=None, cp=1, tp=2, ep=1, sequence_parallel=sequence_parallel)
    model = SimpleNamespace(arch="gpt", num_experts=num_experts)
    DppPlugin().setup(SimpleNamespace(cfg=SimpleNamespace(parallel=layout, model=model)))
