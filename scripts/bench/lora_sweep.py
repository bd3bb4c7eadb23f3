"""The `sweep` half of scripts/bench/lora.py: makespan of LoRA sweeps under the PLoRA planner
against the baseline strategies (sequential, per_job, pack_all).

  simulated               a 32-configuration sweep of a LLaMA-3-8B-shaped model on 8 x 80 GB
                          GPUs, timed by the analytic A100 roofline (costmodel.GpuCostModel;
                          datasheet peaks, assumed efficiencies: no GPU was measured)
  small_instance_max_gap  the heuristic planner's worst makespan ratio to the exact optimum
                          (CP-SAT over rigid packs) on random small sweeps
  measured                a 12-configuration sweep executed for real on this machine by the
                          sweep's executor (lora/runtime/execute.py) in one launch of `--devices`
                          one-thread gloo ranks, a rank per device: packs on separate ranks train
                          at the same time, each job writes its PEFT adapter and megatron
                          checkpoint. The planner uses the linear cost model calibrated here
                          first (calibrate.py). Makespans are CPU seconds of the busiest rank (on
                          a shared machine the wall clock counts other people's work) and,
                          separately, wall seconds, from a barrier to the executor's return.

Run alone: python scripts/bench/lora_sweep.py --json sweep.json [--plot sweep.png]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron_ext.config.schema import ModelConfig  # noqa: E402
from megatron_ext.lora.job import LoraJob  # noqa: E402
from megatron_ext.lora.planning import exact, planner, report  # noqa: E402
from megatron_ext.lora.planning.costmodel import A100_80GB, GpuCostModel  # noqa: E402
from megatron_ext.lora.planning.memory import BF16, FP32, Hardware, MemoryModel  # noqa: E402
from megatron_ext.lora.planning.plan import Pack, Plan  # noqa: E402
from megatron_ext.lora.planning.simulate import Schedule, simulate  # noqa: E402
from megatron_ext.lora.planning.workload import shapes_of  # noqa: E402
from extras import require  # noqa: E402  (scripts/bench/extras.py, beside this script)
from provenance import provenance  # noqa: E402  (scripts/bench/provenance.py, beside this script)

STRATEGIES = ("planner", "sequential", "per_job", "pack_all")
ATTENTION = ("linear_qkv", "linear_proj")
ALL = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")

LLAMA3_8B = ModelConfig(
    name="llama3_8b", num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
    num_query_groups=8, vocab_size=128256, tie_embeddings=False, seq_length=8192,
)
# The CPU sweep's base: small enough that twelve jobs train in minutes on one core each.
CPU_MODEL = ModelConfig(name="lora_bench", num_layers=4, hidden_size=256, ffn_hidden_size=704, num_attention_heads=4,
                        seq_length=128, vocab_size=512)


def gpu_sweep(samples: int = 2000, seq: int = 512) -> list[LoraJob]:
    """rank x lr x batch x targets = 4 x 2 x 2 x 2; each job sees `samples` samples (one epoch),
    so batch-1 jobs take 4x the optimizer steps of batch-4 jobs."""
    jobs = []
    for rank, lr, batch, targets in itertools.product((8, 16, 32, 64), (1e-4, 3e-4), (1, 4), (ATTENTION, ALL)):
        name = f"r{rank}_lr{lr:g}_b{batch}_{'attn' if targets == ATTENTION else 'all'}"
        jobs.append(LoraJob(name, rank=rank, alpha=2 * rank, lr=lr, micro_batch_size=batch, global_batch_size=batch,
                            seq_length=seq, steps=samples // batch, target_modules=targets))
    return jobs


def cpu_sweep(samples: int) -> list[LoraJob]:
    """rank x lr x batch = 3 x 2 x 2 (reference notes, E3)."""
    return [
        LoraJob(f"r{rank}_lr{lr:g}_b{batch}", rank=rank, lr=lr, micro_batch_size=batch, global_batch_size=batch,
                seq_length=CPU_MODEL.seq_length, steps=max(1, samples // batch), eval_iters=0)
        for rank, lr, batch in itertools.product((8, 32, 64), (1e-4, 3e-4), (1, 4))
    ]


def strategy_schedules(problem: planner.Problem) -> dict[str, Optional[Schedule]]:
    out: dict[str, Optional[Schedule]] = {"planner": planner.plan(problem)}
    for name, make in planner.BASELINES.items():
        p = make(problem)
        out[name] = None if p is None else simulate(p, problem.jobs, problem.hardware.devices, problem.memory, problem.cost)
    return out


def simulated(out_dir: Path) -> tuple[dict, Schedule]:
    """The simulated sweep's record, and the planner's schedule (drawn by `draw_gantt`)."""
    shapes = shapes_of(LLAMA3_8B)
    hardware = Hardware(devices=8, memory_bytes=A100_80GB.memory_bytes, reserve_bytes=4 * 10**9)
    problem = planner.Problem(tuple(gpu_sweep()), hardware, MemoryModel(shapes, BF16), GpuCostModel(shapes, A100_80GB))
    start = time.process_time()
    schedules = strategy_schedules(problem)
    seconds = time.process_time() - start
    best = schedules["planner"]
    (out_dir / "lora_sweep_simulated_plan.txt").write_text(report.table(best) + "\n")
    makespans = {k: (None if s is None else s.makespan) for k, s in schedules.items()}
    return {
        "makespan_s": makespans,
        "lower_bound_s": planner.lower_bound(problem),
        "planner_strategy": best.plan.strategy,
        "planner_cpu_s": seconds,
        "peak_gb_per_device": {k: (None if s is None else max(s.peak_bytes) / 1e9) for k, s in schedules.items()},
        "speedup_vs_sequential": makespans["sequential"] / makespans["planner"],
        "setup": {"model": dataclasses.asdict(LLAMA3_8B), "gpu": dataclasses.asdict(A100_80GB), "devices": 8,
                  "reserve_bytes": hardware.reserve_bytes, "jobs": [dataclasses.asdict(j) for j in problem.jobs]},
    }, best


def draw_gantt(planned: Schedule, out_dir: Path) -> None:
    """The simulated sweep's plan as a Gantt chart, `lora_sweep_simulated_gantt.png` in `out_dir`."""
    report.gantt(planned, str(out_dir / "lora_sweep_simulated_gantt.png"),
                 "planner, 32 LoRA jobs of an 8B model on 8 x A100-80GB (simulated)")


def small_instance_gaps(instances: int, seed: int = 0) -> dict:
    """Heuristic alone (no exact solver, no baselines) against CP-SAT's rigid-pack optimum."""
    rng = random.Random(seed)
    shapes = shapes_of(LLAMA3_8B)
    memory, cost = MemoryModel(shapes, BF16), GpuCostModel(shapes, A100_80GB)
    gaps = []
    for _ in range(instances):
        k, devices = rng.randint(3, 6), rng.choice((1, 2, 4))
        jobs = tuple(
            LoraJob(f"j{n}", rank=rng.choice((8, 16, 32, 64)), micro_batch_size=(b := rng.choice((1, 2, 4))),
                    global_batch_size=b, seq_length=rng.choice((256, 512, 1024)), steps=rng.choice((100, 200, 400, 800)),
                    target_modules=rng.choice((ATTENTION, ALL)))
            for n in range(k)
        )
        hardware = Hardware(devices, int(rng.choice((24, 32, 48, 80)) * 10**9))
        problem = planner.Problem(jobs, hardware, memory, cost)
        try:
            planner.check_feasible(problem)
        except ValueError:
            continue
        heuristic = simulate(planner.heuristic(problem), jobs, devices, memory, cost).makespan
        solved = exact.cpsat(problem)
        optimum = simulate(solved, jobs, devices, memory, cost).makespan
        gaps.append({"jobs": k, "devices": devices, "memory_gb": hardware.memory_bytes / 1e9,
                     "ratio": heuristic / optimum, "proven_optimal": solved.strategy == "exact"})
    # Only optima CP-SAT proved count: a time-limited answer could hide a gap.
    ratios = [g["ratio"] for g in gaps if g["proven_optimal"]]
    return {"max": max(ratios), "mean": sum(ratios) / len(ratios), "instances": len(ratios),
            "not_proven_optimal": len(gaps) - len(ratios), "within_5pct": sum(r <= 1.05 for r in ratios),
            "cases": gaps}


# --- the measured sweep ---------------------------------------------------------------------------


def run_ranks(plans: dict[str, Plan], jobs: list[LoraJob], out_dir: str) -> dict:
    """One rank of the measured sweep: each strategy's plan through the sweep's executor
    (execute.py: packs on separate ranks at the same time, one base per rank, per-job PEFT
    adapters and megatron checkpoints), timed from a barrier to the executor's return."""
    import torch.distributed as dist

    from megatron_ext.config import compose_config
    from megatron_ext.lora.runtime.batching import SyntheticData
    from megatron_ext.lora.runtime.execute import execute
    from megatron_ext.models.convert.world import model_parallel_world

    cfg = dataclasses.replace(compose_config(["experiment=lora_sweep"]), model=CPU_MODEL)
    runs = {}
    with model_parallel_world(tp=1):
        # Untimed first: a one-step job per rank pays every first-use cost (allocator, kernels,
        # the first checkpoint) that the first timed strategy would otherwise pay alone.
        warmup = [jobs[0].replace(name=f"warmup{r}", steps=1) for r in range(dist.get_world_size())]
        execute(dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, output_dir=f"{out_dir}/warmup")), warmup,
                Plan("warmup", tuple(Pack((j.name,), 1, 1, 1, (r,)) for r, j in enumerate(warmup))),
                lambda job: SyntheticData(job, CPU_MODEL.vocab_size))
        for name, plan in plans.items():
            run_cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, output_dir=f"{out_dir}/{name}"))
            dist.barrier()
            cpu, wall = time.process_time(), time.perf_counter()
            results = execute(run_cfg, jobs, plan, lambda job: SyntheticData(job, CPU_MODEL.vocab_size))
            mine = {"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall}
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            runs[name] = {"cpu_s": [r["cpu_s"] for r in everyone], "wall_s": [r["wall_s"] for r in everyone],
                          "not_done": sorted(n for n, r in results.items() if r.status != "done")}
    return runs


def execute_all(plans: dict[str, Plan], jobs: list[LoraJob], devices: int, workdir: Path) -> dict:
    """Every plan run by one launch of `devices` one-thread ranks (a rank is a device)."""
    from megatron_ext.platform.launch import launch_local

    os.environ["OMP_NUM_THREADS"] = "1"
    runs = launch_local(devices, run_ranks, (plans, jobs, str(workdir)), "127.0.0.1", 0)[0]
    return {
        name: {**run, "makespan_cpu_s": max(run["cpu_s"]), "makespan_wall_s": max(run["wall_s"])}
        for name, run in runs.items()
    }


def measured(samples: int, devices: int, out_dir: Path, machine: str) -> dict:
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_ext.lora.calibrate import calibrate, fit_record, save_fit
    from megatron_ext.lora.planning.pass_size import AUTO, knee, resolve
    from megatron_ext.models.convert.world import model_parallel_world

    with model_parallel_world():  # left before the ranks launch
        model_parallel_cuda_manual_seed(1234)
        fit, calibration, rates = calibrate(CPU_MODEL, CPU_MODEL.vocab_size)
    save_fit(out_dir / "lora_cost_model.json", fit, len(calibration), knee(rates))  # for lora.cost_model=
    shapes = shapes_of(CPU_MODEL)
    # The cap the executor's ranks run with (their config's lora.max_pass_tokens=auto, on a CPU).
    memory = MemoryModel(shapes, FP32, fused_attention=False, max_pass_tokens=resolve(AUTO, None, cuda=False))
    jobs = cpu_sweep(samples)
    # Room for about half of the sweep at once on a device, so that packing comes in waves.
    extra = sorted((memory.per_device([j], 1, 1).total - memory.base_bytes(1) for j in jobs), reverse=True)
    hardware = Hardware(devices, memory.base_bytes(1) + sum(extra[: len(jobs) // 2]))
    problem = planner.Problem(tuple(jobs), hardware, memory, fit.model, max_tp=1, max_dp=1)
    schedules = strategy_schedules(problem)
    (out_dir / "lora_sweep_measured_plan.txt").write_text(report.table(schedules["planner"]) + "\n")
    plans = {name: dataclasses.replace(s.plan, strategy=name) for name, s in schedules.items() if s is not None}
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        runs = execute_all(plans, jobs, devices, Path(tmp))
    return {
        "makespan_s": {n: (runs[n]["makespan_cpu_s"] if n in runs else None) for n in STRATEGIES},
        "makespan_wall_s": {n: (runs[n]["makespan_wall_s"] if n in runs else None) for n in STRATEGIES},
        "predicted_s": {k: (None if s is None else s.makespan) for k, s in schedules.items()},
        "planner_strategy": schedules["planner"].plan.strategy,
        "runs": runs,
        "cost_model": fit_record(fit, len(calibration), knee(rates)),
        "setup": {"model": dataclasses.asdict(CPU_MODEL), "devices": devices, "memory_bytes": hardware.memory_bytes,
                  "executor": "megatron_ext.lora.runtime.execute.execute, one gloo rank per device (launch_local)",
                  "machine": machine, "jobs": [dataclasses.asdict(j) for j in jobs]},
    }


def needs(args: argparse.Namespace) -> dict[str, Optional[str]]:
    """What the sweep's run needs beyond megatron_ext's dependencies (extras.require)."""
    return {"ortools": "the optimality gap (--gap-instances)" if args.gap_instances else None}


def sweep(args: argparse.Namespace) -> tuple[dict, Schedule]:
    """The JSON's `sweep` object: makespans by strategy, the gap, and the details of each; and
    the simulated sweep's planned schedule, for `draw_gantt`."""
    out_dir = Path(args.json).resolve().parent
    sim, planned = simulated(out_dir)
    gaps = small_instance_gaps(args.gap_instances)
    result = {
        "simulated": sim["makespan_s"],
        "small_instance_max_gap": gaps["max"],
        "simulated_details": sim,
        "small_instance_gaps": gaps,
    }
    if not args.skip_measured:
        m = measured(args.samples, args.devices, out_dir, args.machine)
        result["measured"], result["measured_details"] = m["makespan_s"], m
    return result, planned


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(k, result[k]) for k in ("simulated", "measured") if k in result]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5), squeeze=False)
    for ax, (name, makespans) in zip(axes[0], panels):
        names = [s for s in STRATEGIES if makespans.get(s) is not None]
        values = [makespans[s] / (3600 if name == "simulated" else 1) for s in names]
        ax.bar(names, values, color=["tab:green"] + ["tab:gray"] * (len(names) - 1))
        ax.set_ylabel("makespan (h)" if name == "simulated" else "makespan (CPU s of the busiest worker)")
        ax.set_title(name)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gap-instances", type=int, default=40, help="random small sweeps for the optimality gap")
    p.add_argument("--samples", type=int, default=24, help="samples each job of the measured sweep trains on")
    p.add_argument("--devices", type=int, default=2, help="ranks (devices) of the measured sweep")
    p.add_argument("--skip-measured", action="store_true", help="leave out the measured sweep")
    p.add_argument("--machine", default="", help="what else ran on the machine while measuring (kept in the JSON)")


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--plot")
    add_arguments(p)
    args = p.parse_args(argv)
    require(__file__, {"matplotlib": "--plot" if args.plot else None, **needs(args)})
    result, planned = sweep(args)
    Path(args.json).write_text(json.dumps({"sweep": result, "provenance": provenance(__file__, argv)}, indent=1))
    if args.plot:
        plot(result, args.plot)
        draw_gantt(planned, Path(args.json).resolve().parent)


if __name__ == "__main__":
    main()
