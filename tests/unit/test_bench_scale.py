"""scripts/bench/scale.py's row functions on tiny cases (seconds), so the cluster-scale table
keeps running: each row names its plugin and case, the measured planner time and memory, the
simulated figure and the paper's; the dpp batches are what the case asks for; the lora row's
planner is never worse than a baseline."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.unit._bench_scripts import bench_script


@pytest.fixture(scope="module")
def scale():
    # imported by name from its folder, so that a spawned process finds it too
    with bench_script("scale") as module:
        yield module


def common_fields(row: dict, plugin: str) -> None:
    assert row["plugin"] == plugin and row["case"]
    assert row["planner_wall_s"] > 0 and row["planner_cpu_s"] > 0 and row["peak_rss_bytes"] > 2**20
    assert isinstance(row["met"], bool) and isinstance(row["met_cpu"], bool)
    assert row["paper"]["source"]
    json.dumps(row)  # the row goes into the JSON as it is


def test_dpp_rows_plan_each_replicas_share_of_batches_within_the_token_and_length_limits(scale):
    case = scale.DppCase("llama3-8b", tp=4, pp=4, dp=2, batch_tokens=2**15, max_len=2**13, batches=2)
    (row,) = scale.dpp_rows([case], fresh=False)
    common_fields(row, "dpp")
    assert len(row["batches"]) == 2
    for batch in row["batches"]:
        assert batch["tokens"] <= case.batch_tokens and batch["longest"] <= case.max_len
        # the replicas' shares make up the batch, and the row keeps the slowest of them
        assert sum(r["tokens"] for r in batch["replicas"]) == batch["tokens"]
        assert batch["iter_s"] == max(r["iter_s"] for r in batch["replicas"])
        assert all(r["peak_bytes"] <= scale.CLUSTER["gpu_memory_bytes"] for r in batch["replicas"])
    assert row["simulated"]["iter_s"] == min(b["iter_s"] for b in row["batches"])
    assert row["setup"]["gpus"] == 4 * 4 * 2


def test_the_dpp_stage_holds_one_gpus_share_of_korthikanti_activations(scale):
    shape = scale.dpp_models()["llama3-70b"]
    cost = scale.dpp_stage_cost(shape, tp=8, dp=4)
    # sequence parallelism splits the 34 s b h bytes of a layer's activations over TP
    assert cost.act_bytes_token == pytest.approx(34 * shape.hidden / 8)
    # 8 TP ranks at the cluster's peak and efficiency
    flops = 8 * scale.CLUSTER["peak_bf16_flops"] * scale.CLUSTER["dpp_mfu"]
    assert cost.alpha == pytest.approx(2 * shape.layer_params / flops)


def test_lora_rows_report_the_planner_against_every_baseline(scale):
    case = scale.LoraCase(jobs=8, devices=4, samples=40)
    (row,) = scale.lora_rows([case], fresh=False)
    common_fields(row, "lora")
    sim = row["simulated"]
    assert set(sim["baseline_makespan_s"]) == {"sequential", "per_job", "pack_all"}
    for name, makespan in sim["baseline_makespan_s"].items():
        if makespan is not None:
            assert sim["makespan_s"] <= makespan
            assert sim["baseline_over_planner"][name] == pytest.approx(makespan / sim["makespan_s"])
    assert sim["makespan_s"] >= sim["lower_bound_s"]


def test_the_lora_grid_gives_distinct_jobs_and_refuses_more_than_it_holds(scale):
    jobs = scale.lora_jobs(scale.LoraCase(jobs=50))
    assert len({j.name for j in jobs}) == 50
    with pytest.raises(ValueError, match="grid has 320 points"):
        scale.lora_jobs(scale.LoraCase(jobs=321))


def test_a_fresh_process_measures_its_own_peak_memory(scale):
    result, rss = scale.measured(sum, [1, 2, 3])
    assert result == 6 and rss > 2**20


def test_the_plot_draws_the_rows(scale, tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"plugin": "dpp", "case": "a, b", "planner_wall_s": 1.0, "planner_cpu_s": 0.5, "simulated": {"iter_s": 10.0}},
            {"plugin": "lora", "case": "c", "planner_wall_s": 5.0, "planner_cpu_s": 4.0,
             "simulated": {"baseline_over_planner": {"sequential": 3.0, "pack_all": None}}}]
    scale.plot(rows, str(tmp_path / "scale.png"))
    assert (tmp_path / "scale.png").stat().st_size > 0


def test_reshard_rows_check_bytes_against_the_minimum_and_price_the_move_and_the_checkpoint_route(scale):
    from megatron_ext.config.store import MODEL_PRESETS
    from megatron_ext.parallel.layout import ParallelLayout as L

    model = dataclasses.replace(MODEL_PRESETS["llama_tiny"], vocab_size=256)
    case = scale.ReshardCase("tiny tp2·pp2·dp2 -> tp4·dp2", model, L(tp=2, pp=2, dp=2), L(tp=4, dp=2), 60.0, "70b",
                             stall_ranks="all")
    (row,) = scale.reshard_rows([case], fresh=False)
    common_fields(row, "reshard")
    assert row["bytes"]["network_bytes"] == row["bytes"]["min_bytes"] > 0 and row["bytes"]["equal_min"]
    sim = row["simulated"]
    assert sim["stall_s"] == pytest.approx(sum(sim["stall"].values()))
    assert sim["checkpoint_route_s"] == pytest.approx(sum(sim["checkpoint_route"].values()))
    assert sim["route_over_stall"] == pytest.approx(sim["checkpoint_route_s"] / sim["stall_s"])
    assert sim["ranks_simulated"] == 8 and sim["state_bytes"] > 0
    assert row["paper"]["stall_s"] == 2.0


@pytest.mark.parametrize("budget", [1 << 30, 4096], ids=["one_round", "many_rounds"])
def test_the_ranks_own_rounds_give_the_world_plans_simulated_transfer(scale, budget):
    from megatron_ext.config.store import MODEL_PRESETS
    from megatron_ext.reshard.execute import rounds
    from megatron_ext.parallel.layout import ParallelLayout as L
    from megatron_ext.reshard.plan import plan
    from megatron_ext.reshard.simulate import H100_CLASS, traffic_from_rounds, transfer_seconds

    model = dataclasses.replace(MODEL_PRESETS["llama_tiny"], vocab_size=256)
    a, b = L(tp=2, pp=2, dp=2), L(tp=4, dp=2)
    world = transfer_seconds(traffic_from_rounds(rounds(plan(model, a, b), budget)), H100_CLASS, 8)
    everyone, _ = scale.rank_traffic(model, a, b, list(range(8)), budget)
    assert transfer_seconds(everyone, H100_CLASS, 8) == pytest.approx(world, rel=1e-12)
    # a sample of ranks (with their peers' Traffic) never prices the move above the world
    sample, info = scale.rank_traffic(model, a, b, [0, 7], budget)
    assert transfer_seconds(sample, H100_CLASS, 8) <= world * (1 + 1e-12)
    assert info["ranks_simulated"] == 2
