"""The PLoRA planner on named sweeps: every job scheduled once, memory never exceeded (checked
by the simulator on the active sets that occur, not by the planner's bound), makespan at least
the lower bound, the exact solver equal to brute force on tiny sweeps, the planner never worse
than a baseline, and sweeps that cannot fit refused before planning."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_ext.config.schema import ModelConfig
from megatron_ext.lora.job import LoraJob
from megatron_ext.lora.planning import exact, planner
from megatron_ext.lora.planning.costmodel import GpuCostModel, GpuSpec, LinearCostModel
from megatron_ext.lora.planning.memory import FP32, Hardware, MemoryModel
from megatron_ext.lora.planning.plan import Pack, Plan
from megatron_ext.lora.planning.simulate import simulate
from megatron_ext.lora.planning.workload import shapes_of

TINY = ModelConfig(name="tiny", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, vocab_size=256)
SHAPES = shapes_of(TINY)
MEMORY = MemoryModel(SHAPES, FP32, fused_attention=False)
MIB = 2**20
BASE = MEMORY.base_bytes(1)
# A toy GPU small enough that these tiny models are bound by GEMM efficiency and overheads.
TOY_GPU = GpuSpec("toy", 64 * MIB, peak_flops=2e9, hbm_bytes_per_s=4e9, link_bytes_per_s=1e9, gemm_half_size=32)
COSTS = {
    "linear": LinearCostModel(SHAPES, (2e-3, 5e-4, 3e-3, 6e-3, 2e-3, 0.4)),
    "roofline": GpuCostModel(SHAPES, TOY_GPU),
}


def job(name: str, rank: int = 8, batch: int = 1, steps: int = 20, seq: int = 64, targets=None) -> LoraJob:
    extra = {"target_modules": targets} if targets else {}
    return LoraJob(name=name, rank=rank, micro_batch_size=batch, global_batch_size=batch, steps=steps, seq_length=seq, **extra)


def mixed(n: int) -> tuple[LoraJob, ...]:
    ranks, batches, steps, seqs = (4, 8, 16, 32), (1, 2, 4), (10, 25, 40, 15, 30), (32, 64, 48)
    return tuple(
        job(f"j{i}", ranks[i % 4], batches[i % 3], steps[i % 5], seqs[i % 3], ("linear_qkv", "linear_fc2") if i % 2 else None)
        for i in range(n)
    )


def room_for(jobs, n: int) -> int:
    """Device memory that holds the base and about `n` of these jobs at once."""
    per_job = max(MEMORY.per_device([j], 1, 1).total - BASE for j in jobs)
    return BASE + n * per_job + per_job // 3


# name -> (jobs, devices, room for about this many jobs per device)
SWEEPS = {
    "one device, roomy": (mixed(6), 1, 8),
    "one device, tight": (mixed(6), 1, 2),
    "two devices": (mixed(5), 2, 3),
    "four devices, twelve jobs": (mixed(12), 4, 3),
    "four devices, one job at a time": (mixed(8), 4, 1),
    "eight devices, same jobs": (tuple(job(f"s{i}", steps=30) for i in range(10)), 8, 4),
}


def problem(jobs, devices, room, cost="linear") -> planner.Problem:
    return planner.Problem(jobs, Hardware(devices, room_for(jobs, room)), MEMORY, COSTS[cost])


def strategies(p: planner.Problem) -> dict[str, Plan]:
    plans = {"heuristic": planner.heuristic(p), "planner": planner.plan(p, exact_limit=0).plan}
    plans.update({name: make(p) for name, make in planner.BASELINES.items()})
    return {name: plan for name, plan in plans.items() if plan is not None}


@pytest.mark.parametrize("cost", sorted(COSTS))
@pytest.mark.parametrize("name", sorted(SWEEPS))
def test_every_plan_schedules_each_job_once_within_memory_and_above_the_lower_bound(name, cost):
    jobs, devices, room = SWEEPS[name]
    p = problem(jobs, devices, room, cost)
    bound = planner.lower_bound(p)
    makespans = {}
    for strategy, plan in strategies(p).items():
        schedule = simulate(plan, jobs, devices, MEMORY, p.cost)
        assert sorted(r.job for r in schedule.jobs) == sorted(j.name for j in jobs), strategy
        assert max(schedule.peak_bytes) <= p.hardware.usable_bytes, strategy
        assert schedule.makespan >= bound * (1 - 1e-12), strategy
        # A device never runs two packs at once.
        for d in range(devices):
            runs = sorted((r.start, r.end) for pk, r in zip(plan.packs, schedule.packs) if d in pk.devices)
            assert all(a[1] <= b[0] + 1e-9 for a, b in zip(runs, runs[1:])), strategy
        makespans[strategy] = schedule.makespan
    baselines = [makespans[b] for b in planner.BASELINES if b in makespans]
    assert makespans["planner"] <= min(baselines) * (1 + 1e-12)


# name -> (jobs, devices, room); small enough for brute force over partitions and orders.
TINY_SWEEPS = {
    "three jobs, one device": (mixed(3), 1, 2),
    "four jobs, two devices": (mixed(4), 2, 2),
    "four jobs, two devices, one at a time": (mixed(4), 2, 1),
    "three jobs, four devices": (mixed(3), 4, 2),
    "three long-seq jobs, two devices": (tuple(job(f"l{i}", rank=8 * (i + 1), seq=128, steps=10 + 5 * i) for i in range(3)), 2, 2),
}


@pytest.mark.parametrize("cost", sorted(COSTS))
@pytest.mark.parametrize("name", sorted(TINY_SWEEPS))
def test_exact_solver_equals_brute_force_on_tiny_sweeps(name, cost):
    pytest.importorskip("ortools")
    jobs, devices, room = TINY_SWEEPS[name]
    p = problem(jobs, devices, room, cost)
    brute = simulate(exact.brute_force(p), jobs, devices, MEMORY, p.cost)
    solved = simulate(exact.cpsat(p), jobs, devices, MEMORY, p.cost)
    # CP-SAT rounds durations up to its grid (exact.RESOLUTION); brute force does not.
    assert solved.makespan == pytest.approx(brute.makespan, rel=len(jobs) ** 2 * exact.RESOLUTION)
    assert max(solved.peak_bytes) <= p.hardware.usable_bytes
    # The planner chooses among the exact plan, the heuristic and the baselines.
    assert planner.plan(p).makespan <= brute.makespan * (1 + len(jobs) ** 2 * exact.RESOLUTION)


# Sweeps where the best plan runs short packs side by side on a few devices each next to a
# long one on more devices: a placement that gives each pack the shape that ends it soonest puts
# every short pack on all devices one after another (5-8% longer here).
# name -> (rank, batch, steps, seq) per job, devices, room, cost
SIDE_BY_SIDE = {
    "three jobs, equal lengths": (((4, 4, 80, 48), (16, 1, 80, 48), (4, 2, 80, 32)), 4, 3, "roofline"),
    "three jobs, linear cost": (((8, 4, 80, 48), (8, 4, 40, 32), (8, 2, 80, 48)), 4, 2, "linear"),
    "four jobs": (((4, 2, 80, 48), (32, 2, 40, 48), (8, 4, 10, 48), (8, 1, 80, 48)), 4, 2, "roofline"),
}


@pytest.mark.parametrize("name", sorted(SIDE_BY_SIDE))
def test_heuristic_equals_brute_force_when_short_packs_share_the_devices(name):
    specs, devices, room, cost = SIDE_BY_SIDE[name]
    jobs = tuple(job(f"j{i}", rank, batch, steps, seq) for i, (rank, batch, steps, seq) in enumerate(specs))
    p = problem(jobs, devices, room, cost)
    brute = simulate(exact.brute_force(p), jobs, devices, MEMORY, p.cost).makespan
    assert simulate(planner.heuristic(p), jobs, devices, MEMORY, p.cost).makespan == pytest.approx(brute, rel=1e-12)


def test_event_simulation_equals_stepping_pass_by_pass():
    jobs = mixed(5)
    pack = Pack(tuple(j.name for j in jobs), 1, 2, 2, (0, 1))
    cost = COSTS["roofline"]
    schedule = simulate(Plan("one pack", (pack,)), jobs, 2, MEMORY, cost)
    # Reference: advance one pass at a time, admitting queued jobs into free slots.
    left = {j.name: j.steps * -(-j.global_batch_size // 2 // min(j.micro_batch_size, -(-j.global_batch_size // 2))) for j in jobs}
    by_name = {j.name: j for j in jobs}
    queue, active, now, start, end = list(left), [], 0.0, {}, {}
    while queue or active:
        while queue and len(active) < 2:
            active.append(queue.pop(0))
            start[active[-1]] = now
        now += cost.pass_time([by_name[n] for n in active], 1, 2)
        for n in list(active):
            left[n] -= 1
            if left[n] == 0:
                end[n] = now
                active.remove(n)
    for run in schedule.jobs:
        assert run.start == pytest.approx(start[run.job], rel=1e-9)
        assert run.end == pytest.approx(end[run.job], rel=1e-9)


def test_a_job_that_cannot_fit_alone_is_refused_naming_it_and_its_memory():
    jobs = mixed(3) + (job("huge", rank=512, batch=64, seq=256),)
    p = planner.Problem(jobs, Hardware(2, room_for(mixed(3), 2)), MEMORY, COSTS["linear"])
    with pytest.raises(ValueError, match=r"job 'huge' needs [0-9.]+ GiB per device even alone"):
        planner.plan(p)


BAD_PLANS = {
    "job twice": (Plan("x", (Pack(("j0", "j1"), 1, 1, 1, (0,)), Pack(("j1", "j2"), 1, 1, 1, (1,)))), "scheduled twice"),
    "job missing": (Plan("x", (Pack(("j0", "j1"), 1, 1, 1, (0,)),)), "not scheduled"),
    "device outside": (Plan("x", (Pack(("j0", "j1", "j2"), 1, 1, 1, (2,)),)), "outside"),
    "too few devices": (Plan("x", (Pack(("j0", "j1", "j2"), 2, 1, 1, (0,)),)), "needs 2 distinct devices"),
}


@pytest.mark.parametrize("name", sorted(BAD_PLANS))
def test_malformed_plans_are_refused(name):
    plan, message = BAD_PLANS[name]
    with pytest.raises(ValueError, match=message):
        simulate(plan, mixed(3), 2, MEMORY, COSTS["linear"])


BAD_SWEEPS = {
    "duplicate names": (lambda: planner.Problem((job("a"), job("a")), Hardware(1, 1 << 40), MEMORY, COSTS["linear"]), "duplicate"),
    "unknown target module": (lambda: job("a", targets=("linear_q",)), "unknown target module"),
    "no jobs": (lambda: planner.Problem((), Hardware(1, 1 << 40), MEMORY, COSTS["linear"]), "no jobs"),
    "moe model": (lambda: shapes_of(dataclasses.replace(TINY, num_experts=4)), "MoE"),
}


@pytest.mark.parametrize("name", sorted(BAD_SWEEPS))
def test_bad_sweeps_are_refused_with_a_clear_message(name):
    build, message = BAD_SWEEPS[name]
    with pytest.raises(ValueError, match=message):
        build()


def test_the_table_lists_every_pack_and_job_and_the_gantt_chart_is_written(tmp_path):
    from megatron_ext.lora.planning import report

    jobs, devices, room = SWEEPS["four devices, twelve jobs"]
    schedule = planner.plan(problem(jobs, devices, room), exact_limit=0)
    lines = report.table(schedule).splitlines()
    assert len(lines) == len(schedule.plan.packs) + 2
    assert all(sum(f"{j.name} (" in line for line in lines) == 1 for j in jobs)
    pytest.importorskip("matplotlib")  # the `bench` extra, not the test one
    report.gantt(schedule, str(tmp_path / "gantt.png"))
    assert (tmp_path / "gantt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
