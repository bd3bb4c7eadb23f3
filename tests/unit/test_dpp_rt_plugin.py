"""The dpp plugin's planning step on one rank: a budget no plan meets is refused before any
step runs, naming a minimum budget that does admit a plan; bad config, layouts DPP cannot
train and a missing or mismatched cost model are refused early."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from megatron_ext.config.validate import ConfigError
from megatron_ext.dpp.planning.costmodel import CostModel
from megatron_ext.dpp.plugin import DppConfig, DppPlugin, StepPlanner
from megatron_ext.dpp.planning.simulate import memory_peaks

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


def run_config(parallel: dict, model: dict):
    from megatron_ext.config.schema import Config, ParallelConfig
    from megatron_ext.config.store import MODEL_PRESETS

    return Config(model=dataclasses.replace(MODEL_PRESETS["llama_tiny"], **model), parallel=ParallelConfig(**parallel))


@pytest.fixture
def calibrated(tmp_path) -> str:
    """A cost model calibrated for llama_tiny at TP=1."""
    from megatron_ext.config.store import MODEL_PRESETS
    from megatron_ext.dpp.config import layer_shape

    path = tmp_path / "cost.json"
    COST.to_json(path, shape=dict(layer_shape(MODEL_PRESETS["llama_tiny"]), tp=1, sequence_parallel=False))
    return str(path)


# (parallel, model) of the run -> the field the refusal names
REFUSED = {
    "hybrid": ({}, {"arch": "hybrid"}, "model.arch"),
    "cp": ({"cp": 2}, {}, "parallel.cp"),
    "vpp": ({"vpp": 2}, {}, "parallel.vpp"),
    "ep": ({"ep": 2}, {"num_experts": 4}, "parallel.ep"),
    "sp_moe_aux_loss": ({"tp": 2, "sequence_parallel": True}, MOE_WITH_AUX_LOSS, "model.moe_aux_loss_coeff"),
    "calibrated_at_tp1": ({"tp": 2}, {}, "dpp.cost_model"),
    "calibrated_for_another_width": ({}, {"hidden_size": 256}, "dpp.cost_model"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_unsupported_layouts_are_refused(case, calibrated):
    parallel, model, field = REFUSED[case]
    with pytest.raises(ConfigError) as refused:
        DppPlugin(DppConfig(cost_model=calibrated)).check_layout(run_config(parallel, model), 1)
    assert refused.value.field == field


def test_megatron_realtime_test_is_refused(calibrated):
    """Its all-gather over the data-parallel replicas in every attention forward would not pair
    up: the replicas' plans differ."""
    from megatron_ext.config.schema import TrainConfig

    run = dataclasses.replace(
        run_config({}, {"qk_layernorm": True, "normalization": "LayerNorm"}), train=TrainConfig(test_mode=True)
    )
    with pytest.raises(ConfigError, match="real-time test") as refused:
        DppPlugin(DppConfig(cost_model=calibrated)).check_layout(run, 1)
    assert refused.value.field == "train.test_mode"


@pytest.mark.parametrize("cost_model, message", [(None, "give a cost model"), ("missing.json", "is not a file")])
def test_a_missing_cost_model_is_refused(cost_model, message):
    with pytest.raises(ConfigError, match=message) as refused:
        DppPlugin(DppConfig(cost_model=cost_model)).check_layout(run_config({}, {}), 1)
    assert refused.value.field == "dpp.cost_model"


# (sequence parallel, model): MoE with an auxiliary loss is fine where no chunk is padded
@pytest.mark.parametrize("sequence_parallel,model", [
    (False, {}), (True, {}), (True, {"num_experts": 4}), (False, MOE_WITH_AUX_LOSS),
])
def test_tensor_parallelism_and_moe_are_accepted(sequence_parallel, model, tmp_path):
    from megatron_ext.dpp.config import layer_shape

    run = run_config({"tp": 2, "sequence_parallel": sequence_parallel}, model)
    path = tmp_path / "cost.json"
    COST.to_json(path, shape=dict(layer_shape(run.model), tp=2, sequence_parallel=sequence_parallel))
    DppPlugin(DppConfig(cost_model=str(path))).check_layout(run, 2)


# what a run is given -> the field its refusal names, and the words it says
BEFORE_LAUNCH = {
    "no_cost_model": (["dpp.cost_model=null"], "dpp.cost_model", "give a cost model"),
    "context_parallel": (["parallel.cp=2", "launcher.nproc=4"], "parallel.cp", "context parallelism"),
    "scheduled_move_to_context_parallel": (
        ["plugins=[reshard,dpp]", "launcher.nproc=4", "reshard.schedule=[{step: 2, layout: {cp: 2}}]"],
        "parallel.cp", "context parallelism"),
    "scheduled_move_to_a_tp_not_calibrated": (
        ["plugins=[reshard,dpp]", "reshard.schedule=[{step: 2, layout: {tp: 2, pp: 1}}]"],
        "dpp.cost_model", r"tp 1 \(this run: 2\)"),
}


@pytest.mark.parametrize("case", BEFORE_LAUNCH)
def test_refused_before_any_worker_starts(case, calibrated):
    from megatron_ext.train import run_from_overrides

    overrides, field, message = BEFORE_LAUNCH[case]
    base = ["experiment=none", "plugins=[dpp]", "parallel.pp=2", "launcher.nproc=2", "train.iters=2",
            f"dpp.cost_model={calibrated}"]
    with pytest.raises(ConfigError, match=message) as refused:
        run_from_overrides([*base, *overrides])
    assert refused.value.field == field
