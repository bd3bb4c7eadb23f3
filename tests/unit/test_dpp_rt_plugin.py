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


MOE_WITH_AUX_LOSS = {"num_experts": 4, "moe_aux_loss_coeff": 0.01}


@pytest.mark.parametrize("parallel,model,message", [
    ({}, {"arch": "hybrid"}, "model.arch=gpt"),
    ({"cp": 2}, {}, "parallel.cp"),
    ({"vpp": 2}, {}, "parallel.vpp"),
    ({"ep": 2}, {"num_experts": 4}, "parallel.ep"),
    ({"tp": 2, "sequence_parallel": True}, MOE_WITH_AUX_LOSS, "moe_aux_loss_coeff"),
])
def test_unsupported_setups_are_refused(parallel, model, message):
    from types import SimpleNamespace

    layout = SimpleNamespace(**{"vpp": None, "cp": 1, "tp": 1, "ep": 1, "sequence_parallel": False, **parallel})
    model = SimpleNamespace(**{"arch": "gpt", "num_experts": None, "moe_aux_loss_coeff": 0.0, **model})
    with pytest.raises(ValueError, match=message):
        DppPlugin().setup(SimpleNamespace(cfg=SimpleNamespace(parallel=layout, model=model)))


# (sequence parallel, model): MoE with an auxiliary loss is fine where no chunk is padded
@pytest.mark.parametrize("sequence_parallel,model", [
    (False, {}), (True, {}), (True, {"num_experts": 4}), (False, MOE_WITH_AUX_LOSS),
])
def test_tensor_parallelism_and_moe_are_accepted(sequence_parallel, model):
    from types import SimpleNamespace

    layout = SimpleNamespace(vpp=None, cp=1, tp=2, ep=1, sequence_parallel=sequence_parallel)
    model = SimpleNamespace(**{"arch": "gpt", "num_experts": None, "moe_aux_loss_coeff": 0.0, **model})
    DppPlugin().setup(SimpleNamespace(cfg=SimpleNamespace(parallel=layout, model=model)))
