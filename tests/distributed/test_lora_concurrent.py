"""Two packs of a sweep plan on separate ranks train at the same time (2 gloo ranks, one pack on
each; or 4, one pack on ranks {0, 1}, the other on {2, 3}, each data-parallel over its two ranks),
and every job ends
exactly as when its pack runs alone on the same ranks while the other two ranks idle: the same
losses, eval losses and tokens, and the same adapter in its megatron checkpoint (written by the
pack's ranks) and its PEFT export (written by the pack's first rank).

A pack summing its gradients over the wrong ranks, voting with the other pack, or writing another
pack's files breaks the equality or hangs (the worker has a timeout).

This file is also the worker script torchrun starts for four ranks; on two, its worker runs in the
launch it shares with test_lora_dp (_lora_two_ranks.py).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_lora_sweep import TINY  # noqa: E402

from megatron_ext.lora.job import LoraJob  # noqa: E402
from megatron_ext.lora.planning.plan import Pack, Plan  # noqa: E402

JOBS = [
    LoraJob("a", rank=4, lr=1e-2, steps=2, micro_batch_size=1, global_batch_size=2, seq_length=16, dropout=0.1),
    LoraJob("b", rank=8, lr=3e-2, steps=1, micro_batch_size=1, global_batch_size=2, seq_length=12, seed=5),
    LoraJob("c", rank=2, lr=2e-2, steps=1, micro_batch_size=1, global_batch_size=4, seq_length=16, seed=9),
    LoraJob("d", rank=4, lr=5e-3, steps=2, micro_batch_size=2, global_batch_size=4, seq_length=8, seed=3,
            target_modules=("linear_qkv", "linear_fc2")),
]


def plans(world: int) -> dict[str, Plan]:
    """Two packs, each on half of the world's ranks (data-parallel over them when there are two)."""
    half = world // 2
    first = Pack(("a", "b"), 1, half, 2, tuple(range(half)))
    second = Pack(("c", "d"), 1, half, 1, tuple(range(half, world)))
    return {"concurrent": Plan("test", (first, second)), "first": Plan("test", (first,)), "second": Plan("test", (second,))}


def worker(out: str, part: str) -> None:
    import torch.distributed as dist

    from megatron_ext.config import compose_config
    from megatron_ext.lora.runtime.batching import SyntheticData
    from megatron_ext.lora.runtime.execute import execute
    from megatron_ext.lora.sweep import jobs_of, run_sweep
    from megatron_ext.models.convert.world import model_parallel_world
    from megatron_ext.platform.launch import join_world

    join_world("cpu")
    if part == "sweep":  # from a config: whatever the planner makes of four ranks runs to the end
        entries = [{**dataclasses.asdict(j), "target_modules": list(j.target_modules), "dataset": "synthetic"} for j in JOBS]
        sweep_cfg = compose_config([*TINY, f"lora.output_dir={out}/sweep"])
        sweep_cfg = dataclasses.replace(sweep_cfg, lora=dataclasses.replace(sweep_cfg.lora, jobs=entries))
        summary = run_sweep(sweep_cfg, jobs_of(sweep_cfg))
        assert all(s["status"] == "done" for s in summary.values()), summary
        return
    cfg = compose_config(TINY)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=257))
    with model_parallel_world(tp=1):
        plan_of = plans(dist.get_world_size())
        for name, plan in plan_of.items():
            run_cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, output_dir=f"{out}/{name}"))
            jobs = [j for j in JOBS if any(j.name in p.jobs for p in plan.packs)]
            results = execute(run_cfg, jobs, plan, lambda job: SyntheticData(job, 257))
            if dist.get_rank() == 0:
                (Path(out) / f"{name}.json").write_text(json.dumps({n: dataclasses.asdict(r) for n, r in results.items()}))


if __name__ == "__main__":
    worker(*sys.argv[1:])


def outcome(out: Path, name: str) -> dict:  # in a world of one
    from safetensors.torch import load_file

    from megatron_ext.lora.export import load_megatron

    found = {}
    for job, r in json.loads((out / f"{name}.json").read_text()).items():
        _, weights = load_megatron(out / name / job / "checkpoint")
        peft = load_file(out / name / job / "adapter" / "adapter_model.safetensors")
        found[job] = ({k: r[k] for k in ("status", "steps", "losses", "eval_losses", "tokens")}, weights, peft)
    return found


def assert_same_outcomes(found: dict, expected: dict, jobs: list[LoraJob]) -> None:
    """Every job trained to the end, with the same results (floats exactly) and bitwise the same
    megatron checkpoint and PEFT adapter in both."""
    assert found.keys() == expected.keys() == {j.name for j in jobs}
    for job in jobs:
        (results, weights, peft), (e_results, e_weights, e_peft) = found[job.name], expected[job.name]
        assert results["status"] == "done" and results["steps"] == job.steps, job.name
        assert results == e_results, job.name
        assert weights.keys() == e_weights.keys() and peft.keys() == e_peft.keys()
        assert all(torch.equal(weights[k][i], e_weights[k][i]) for k in weights for i in (0, 1)), job.name
        assert all(torch.equal(peft[k], e_peft[k]) for k in peft), job.name
        assert any(b.abs().max() > 0 for _, b in weights.values()), f"{job.name} never trained"


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world",
    # four ranks: 50 s of wall time on two cores
    [2, pytest.param(4, marks=pytest.mark.slow)],
    ids=["one-rank-packs", "dp2-packs"],
)
def test_packs_on_separate_ranks_at_once_equal_each_pack_alone(tmp_path, tmp_path_factory, world):
    from _torchrun import torchrun

    from megatron_ext.models.convert.world import model_parallel_world

    if world == 2:  # the launch test_lora_dp shares (_lora_two_ranks.py): one startup for both
        from _lora_two_ranks import outputs

        out = outputs(tmp_path_factory) / "concurrent"
    else:
        out = tmp_path
        torchrun(__file__, world, str(out), "packs", timeout=300)
    with model_parallel_world():
        concurrent = outcome(out, "concurrent")
        alone = {**outcome(out, "first"), **outcome(out, "second")}
    assert_same_outcomes(concurrent, alone, JOBS)


@pytest.mark.slow  # the planner (its exact solver) on four ranks, then the sweep: about a minute
@pytest.mark.distributed
def test_a_sweep_planned_over_four_ranks_runs_to_the_end(tmp_path):
    from _torchrun import torchrun

    torchrun(__file__, 4, str(tmp_path), "sweep", timeout=300)
    summary = json.loads((tmp_path / "sweep" / "summary.json").read_text())
    assert sorted(summary) == sorted(j.name for j in JOBS) and all(s["status"] == "done" for s in summary.values())
