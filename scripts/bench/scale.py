"""The planners at cluster scale: one row per case, each planner timed on this machine and its
plan priced by the plugin's own simulator on an H100-class cluster (`CLUSTER`, named in the
JSON), beside the paper's figure where the paper gives one.

    python scripts/bench/scale.py --json scripts/bench/results/scale.json --plot scripts/bench/results/scale.png

Rows (each plugin's rows come from its own function; `main` concatenates them):

- `dpp`: the DPP planner (`dpp.planner.plan_step_info`, policy `dpp`) on 4M-token global
  batches of the InfiniPipe GitHub length fit with every length x4, truncated at 512K tokens,
  for a PP=16 pipeline of LLaMA-3-8B (TP4) and LLaMA-3-70B (TP8), with one data-parallel
  replica planning the whole batch and with four planning their shares (`dpp.batch.dp_share`)
  at once. Per case: the planner's wall and CPU seconds per batch (the slowest replica's) and
  the iteration the plan is predicted to take on `CLUSTER` (the slowest replica's; the
  replicas meet at the gradient reduction). The planner must finish within that iteration.
- `lora`: the PLoRA planner (`lora.planner.plan`) for a sweep of 256 LoRA jobs of LLaMA-3-8B
  on 256 GPUs, against the baselines of `lora.planner.BASELINES`, all timed by the GPU
  roofline (`lora.costmodel.GpuCostModel`) with `CLUSTER`'s GPU. The planner must finish
  within 60 s and never be worse than a baseline.
- `reshard`: a rank's own reshard plan (`reshard.plan_scale.measure_rank_plan`, the slowest of
  the sampled ranks) for rank_plan.py's three SCALE targets (70B at 1,024 ranks, 405B at
  16,384, the Qwen3-235B-A22B MoE EP8 -> EP16 at 1,024) and DynaTrain's two claims (70B on 64
  GPUs, the 235B MoE on 128), bytes moved against the minimum, the live stall and the
  checkpoint route on `H100_CLASS` (`reshard.simulate`), beside DynaTrain's figure. The stall
  is fed from the ranks' own rounds (`rank_traffic`), never the world plan.

Times: `planner_wall_s` is this machine's wall clock (2 shared cores: other work counts),
`planner_cpu_s` the process's CPU time (the planner's own cost, whatever else runs;
`load_average_1min` says how busy the machine was); `met` judges the wall time, `met_cpu` the CPU
time. `peak_rss_bytes` is the peak resident set of a fresh
process that ran only that case (`resource.getrusage`).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import multiprocessing
import os
import random
import re
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron_ext.reshard.simulate import H100_CLASS  # noqa: E402
from extras import require  # noqa: E402  (scripts/bench/extras.py, beside this script)
from provenance import provenance  # noqa: E402  (scripts/bench/provenance.py, beside this script)

# The cluster every simulated figure is priced on: the reshard simulator's H100-class cluster
# (its links, node size and HBM) and the GPU's compute and memory (H100-SXM5-80GB datasheet);
# the efficiencies are assumptions, named with them.
CLUSTER = {
    "name": H100_CLASS.name,
    "gpu": "H100-SXM5-80GB",
    "gpus_per_node": H100_CLASS.gpus_per_node,
    "gpu_memory_bytes": 80 * 10**9,
    "peak_bf16_flops": 989e12,  # dense
    "hbm_bytes_per_s": 2 * H100_CLASS.copy_bandwidth,  # the simulator's copies move each byte twice
    "nvlink_bytes_per_s": H100_CLASS.intra.bandwidth,  # one direction per GPU
    "ib_bytes_per_s": H100_CLASS.inter.bandwidth,  # one direction per GPU
    "sources": dict(H100_CLASS.sources),
    # dpp: the fraction of peak a large chunk's layers reach (half of it at `dpp_t0_tokens`)
    "dpp_mfu": 0.45,
    "dpp_t0_tokens": 1024,
}

PAPERS = {
    "dpp": {
        "figure": "planning (the checkpointing ILP, 2% gap) is fully overlapped with training: its amortised "
                  "cost stays below the iteration time up to 128 GPUs (InfiniPipe, Fig. 12; 32-128 A800-80GB, "
                  "LLaMA 7B-30B, contexts 48K-192K)",
        "planner_below_iteration": True,
        "source": "the project's paper notes, dpp.md section 2 (Accuracy and overhead)",
    },
    "lora": {
        "figure": "up to 7.52x lower sweep makespan than existing approaches (PLoRA abstract, arXiv 2508.02932)",
        "makespan_reduction_max": 7.52,
        "source": "the project's paper notes, plora.md section 0 and 1.7; the DynaTrain abstract",
    },
}


# --- measuring a case in a fresh process -------------------------------------------------------


def _call_and_measure(fn: Callable, args: tuple) -> tuple[Any, int]:
    result = fn(*args)
    return result, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measured(fn: Callable, *args: Any, fresh: bool = True) -> tuple[Any, int]:
    """`fn(*args)` and the peak RSS (bytes) of the process that ran it: a fresh spawned one
    (`fresh`), so the peak is that case's alone, or this one (a test's tiny case)."""
    if not fresh:
        return _call_and_measure(fn, args)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_call_and_measure, (fn, args))


def _measures(rss: int) -> dict:
    """The row's memory, and the machine's load when its case ended (wall times count it)."""
    return {"peak_rss_bytes": rss, "load_average_1min": os.getloadavg()[0]}


# --- dpp ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DppCase:
    model: str  # a key of DPP_MODELS
    tp: int
    pp: int
    dp: int
    batch_tokens: int = 4 * 2**20
    max_len: int = 512 * 2**10
    length_scale: float = 4.0  # every length of the GitHub fit times this
    batches: int = 3

    @property
    def name(self) -> str:
        return (f"{self.model} TP{self.tp}xPP{self.pp}xDP{self.dp}, {self.batch_tokens / 2**20:g}M-token batches, "
                f"GitHub x{self.length_scale:g} <= {self.max_len // 2**10}K")


def dpp_models() -> dict:
    from megatron_ext.dpp.planning.costmodel import ModelShape

    return {
        "llama3-8b": ModelShape("llama3-8b", num_layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256),
        "llama3-70b": ModelShape("llama3-70b", num_layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256),
    }


DPP_CASES = (
    DppCase("llama3-8b", tp=4, pp=16, dp=1),
    DppCase("llama3-8b", tp=4, pp=16, dp=4),
    DppCase("llama3-70b", tp=8, pp=16, dp=1),
    DppCase("llama3-70b", tp=8, pp=16, dp=4),
)


def dpp_stage_cost(shape, tp: int, dp: int, cluster: dict = CLUSTER):
    """The DPP cost model of one pipeline stage of `tp` GPUs of `cluster`: the analytic model
    (`dpp.costmodel.analytic_gpu`) with the stage's FLOP/s (tp GPUs at the cluster's peak and
    `dpp_mfu`), stage-to-stage transfers over InfiniBand (each TP rank sends its sequence-
    parallel share), activations, logits and weights split over TP (Megatron TP with sequence
    parallelism) and Adam's state over DP (ZeRO-1); bytes are one GPU's."""
    from megatron_ext.dpp.planning.costmodel import analytic_gpu

    cost = analytic_gpu(shape, peak_flops=tp * cluster["peak_bf16_flops"], mfu=cluster["dpp_mfu"],
                        t0=cluster["dpp_t0_tokens"], p2p_bytes_s=tp * cluster["ib_bytes_per_s"], zero_shards=dp)
    per_gpu = ("act_bytes_token", "act_bytes_key", "ckpt_bytes_token", "kv_bytes_token", "head_bytes_token",
               "state_bytes_param")
    return dataclasses.replace(cost, **{f: getattr(cost, f) / tp for f in per_gpu})


def global_batch(case: DppCase, seed: int) -> list[int]:
    """Sequence lengths drawn from the scaled GitHub fit, each cut at `max_len`, as many as fit
    in `batch_tokens` tokens."""
    import numpy as np

    from megatron_ext.dpp.planning.lengths import GITHUB, LogNormal

    dist = LogNormal(f"github_x{case.length_scale:g}", GITHUB.mu + math.log(case.length_scale), GITHUB.sigma)
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    total = 0
    while True:
        for n in np.minimum(dist.sample(1024, rng), case.max_len).tolist():
            if total + n > case.batch_tokens:
                return lengths
            lengths.append(int(n))
            total += n


def _plan_dpp_case(case: DppCase) -> dict:
    """Plan `case.batches` global batches, each replica's share on its own, on this process."""
    from megatron_ext.dpp.planning.planner import plan_step_info
    from megatron_ext.dpp.runtime.batch import dp_share

    shape = dpp_models()[case.model]
    cost = dpp_stage_cost(shape, case.tp, case.dp)
    # A running planner is warm: its first call's imports and the solver's start-up are not a batch's.
    plan_step_info([4096] * 4, cost, case.pp, CLUSTER["gpu_memory_bytes"])
    batches = []
    for seed in range(case.batches):
        lengths = global_batch(case, seed)
        replicas = []
        for rank in range(case.dp):
            share = [lengths[i] for i in dp_share(lengths, case.dp, rank)]
            wall = time.perf_counter()
            plan, info = plan_step_info(share, cost, case.pp, CLUSTER["gpu_memory_bytes"])
            replicas.append({"wall_s": time.perf_counter() - wall, "cpu_s": info.planner_s,
                             "iter_s": info.predicted_iter_s, "chunks": len(plan.chunks), "k": info.k,
                             "groups": info.groups, "peak_bytes": max(info.peak_bytes), "tokens": sum(share)})
        batches.append({
            "sequences": len(lengths), "tokens": sum(lengths), "longest": max(lengths),
            # replicas plan at once, and step together: the slowest of each
            "planner_wall_s": max(r["wall_s"] for r in replicas), "planner_cpu_s": max(r["cpu_s"] for r in replicas),
            "iter_s": max(r["iter_s"] for r in replicas), "replicas": replicas,
        })
    return {"batches": batches}


def dpp_rows(cases: Sequence[DppCase] = DPP_CASES, fresh: bool = True) -> list[dict]:
    rows = []
    for case in cases:
        result, rss = measured(_plan_dpp_case, case, fresh=fresh)
        batches = result["batches"]
        wall = [b["planner_wall_s"] for b in batches]
        iters = [b["iter_s"] for b in batches]
        rows.append({
            "plugin": "dpp", "case": case.name,
            "planner_wall_s": max(wall), "planner_wall_s_median": statistics.median(wall),
            "planner_cpu_s": max(b["planner_cpu_s"] for b in batches), **_measures(rss),
            "simulated": {"iter_s": min(iters), "iter_s_median": statistics.median(iters),
                          "planner_over_iter_max": max(w / i for w, i in zip(wall, iters))},
            "target": "planner time < the simulated iteration it plans, every batch",
            "met": all(w < i for w, i in zip(wall, iters)),
            "met_cpu": all(b["planner_cpu_s"] < b["iter_s"] for b in batches),
            "paper": PAPERS["dpp"],
            "setup": {**dataclasses.asdict(case), "gpus": case.tp * case.pp * case.dp,
                      "cost_model": dataclasses.asdict(dpp_stage_cost(dpp_models()[case.model], case.tp, case.dp)),
                      "budget_bytes_per_gpu": CLUSTER["gpu_memory_bytes"]},
            "batches": batches,
        })
        print(f"dpp  {case.name}: planner {max(wall):.2f} s (median {statistics.median(wall):.2f} s), "
              f"iteration {min(iters):.2f}-{max(iters):.2f} s, RSS {rss / 2**20:.0f} MiB", flush=True)
    return rows


# --- lora --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LoraCase:
    jobs: int = 256
    devices: int = 256
    samples: int = 2000  # each job trains one epoch of this many samples
    seed: int = 0
    limit_s: float = 60.0

    @property
    def name(self) -> str:
        return f"{self.jobs} LoRA jobs of llama3-8b on {self.devices} GPUs"


LORA_CASES = (LoraCase(),)
RANKS = (8, 16, 32, 64, 128)
LRS = (1e-4, 3e-4)
BATCHES = (1, 2, 4, 8)
SEQ_LENGTHS = (512, 1024, 2048, 4096)


def lora_gpu():
    from megatron_ext.lora.planning.costmodel import GpuSpec

    # The roofline's efficiencies keep GpuSpec's defaults (assumed, as for the A100 sweep).
    return GpuSpec(CLUSTER["gpu"], CLUSTER["gpu_memory_bytes"], CLUSTER["peak_bf16_flops"], CLUSTER["hbm_bytes_per_s"],
                   CLUSTER["nvlink_bytes_per_s"])


def lora_jobs(case: LoraCase) -> list:
    """`case.jobs` distinct points of the grid rank x lr x micro-batch x sequence length x
    targets (attention only / every linear), drawn with `case.seed`; each trains
    `case.samples` samples."""
    from megatron_ext.lora.job import LoraJob

    attention, every = ("linear_qkv", "linear_proj"), ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    grid = list(itertools.product(RANKS, LRS, BATCHES, SEQ_LENGTHS, (attention, every)))
    if case.jobs > len(grid):
        raise ValueError(f"lora case: {case.jobs} jobs, but the grid has {len(grid)} points")
    points = random.Random(case.seed).sample(grid, case.jobs)
    return [LoraJob(f"r{r}_lr{lr:g}_b{b}_s{s}_{'attn' if t == attention else 'all'}", rank=r, alpha=2 * r, lr=lr,
                    micro_batch_size=b, global_batch_size=b, seq_length=s, steps=max(1, case.samples // b),
                    target_modules=t) for r, lr, b, s, t in points]


def lora_problem(case: LoraCase):
    from megatron_ext.config.schema import ModelConfig
    from megatron_ext.lora.planning import planner
    from megatron_ext.lora.planning.costmodel import GpuCostModel
    from megatron_ext.lora.planning.memory import BF16, Hardware, MemoryModel
    from megatron_ext.lora.planning.workload import shapes_of

    model = ModelConfig(name="llama3_8b", num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
                        num_attention_heads=32, num_query_groups=8, vocab_size=128256, tie_embeddings=False,
                        seq_length=max(SEQ_LENGTHS))
    shapes = shapes_of(model)
    hardware = Hardware(devices=case.devices, memory_bytes=CLUSTER["gpu_memory_bytes"], reserve_bytes=4 * 10**9)
    return planner.Problem(tuple(lora_jobs(case)), hardware, MemoryModel(shapes, BF16), GpuCostModel(shapes, lora_gpu()),
                           max_tp=CLUSTER["gpus_per_node"])


def _plan_lora_case(case: LoraCase) -> dict:
    from megatron_ext.lora.planning import planner
    from megatron_ext.lora.planning.simulate import simulate

    problem = lora_problem(case)
    wall, cpu = time.perf_counter(), time.process_time()
    schedule = planner.plan(problem)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    baselines = {}
    for name, make in planner.BASELINES.items():
        p = make(problem)
        baselines[name] = None if p is None else simulate(p, problem.jobs, case.devices, problem.memory, problem.cost).makespan
    return {"wall_s": wall, "cpu_s": cpu, "makespan_s": schedule.makespan, "strategy": schedule.plan.strategy,
            "packs": len(schedule.plan.packs), "lower_bound_s": planner.lower_bound(problem), "baselines": baselines,
            "peak_bytes": max(schedule.peak_bytes)}


def lora_rows(cases: Sequence[LoraCase] = LORA_CASES, fresh: bool = True) -> list[dict]:
    rows = []
    for case in cases:
        r, rss = measured(_plan_lora_case, case, fresh=fresh)
        ratios = {k: (None if v is None else v / r["makespan_s"]) for k, v in r["baselines"].items()}
        worse = [k for k, v in r["baselines"].items() if v is not None and r["makespan_s"] > v]
        rows.append({
            "plugin": "lora", "case": case.name,
            "planner_wall_s": r["wall_s"], "planner_cpu_s": r["cpu_s"], **_measures(rss),
            "simulated": {"makespan_s": r["makespan_s"], "baseline_makespan_s": r["baselines"],
                          "baseline_over_planner": ratios, "lower_bound_s": r["lower_bound_s"],
                          "strategy": r["strategy"], "packs": r["packs"], "peak_bytes_per_gpu": r["peak_bytes"]},
            "target": f"planner time <= {case.limit_s:g} s and makespan <= every baseline's",
            "met": r["wall_s"] <= case.limit_s and not worse,
            "met_cpu": r["cpu_s"] <= case.limit_s and not worse,
            "paper": PAPERS["lora"],
            "setup": {**dataclasses.asdict(case), "model": "llama3-8b (32 layers, h4096, ffn 14336, 32/8 heads, "
                      "vocab 128256)", "gpu": dataclasses.asdict(lora_gpu()), "reserve_bytes_per_gpu": 4 * 10**9,
                      "grid": {"rank": RANKS, "lr": LRS, "micro_batch": BATCHES, "seq_length": SEQ_LENGTHS,
                               "targets": ["attention", "all"]}},
        })
        best = {k: v for k, v in ratios.items() if v is not None}
        print(f"lora {case.name}: planner {r['wall_s']:.1f} s, makespan {r['makespan_s'] / 3600:.2f} h, "
              f"baselines / planner {', '.join(f'{k} {v:.2f}x' for k, v in best.items())}, "
              f"RSS {rss / 2**20:.0f} MiB", flush=True)
    return rows


# --- reshard -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ReshardCase:
    name: str
    model: Any  # ModelConfig
    a: Any  # ParallelLayout
    b: Any
    target_s: Optional[float]  # per-rank plan time target (issue 27), None where none is set
    paper: Optional[str]  # a key of RESHARD_PAPER: DynaTrain's figure for this model
    stall_ranks: str = "ends"  # "ends": the first and last rank and the slowest planner; "all": every rank


RESHARD_BUDGET_BYTES = 1 << 30  # a rank's staging budget per round on an 80 GB GPU: assumption
RESHARD_RSS_TARGET_MB = 300
RESHARD_PAPER = {
    "70b": {"figure": "a 70B dense model reconfigured end to end in under 2 s (DynaTrain abstract; its GPUs and "
                      "layouts are not given)", "stall_s": 2.0,
            "source": "the DynaTrain abstract (abstract); the project's paper notes, dynatrain.md "
                      "lines 17, 44, 126"},
    "235b_moe": {"figure": "a 235B MoE model reconfigured in 4.36 s (DynaTrain abstract; its GPUs and layouts are not "
                           "given)", "stall_s": 4.36,
                 "source": "the DynaTrain abstract (abstract); the project's paper notes, dynatrain.md "
                           "lines 17, 44, 126"},
}


def reshard_cases() -> tuple[ReshardCase, ...]:
    """rank_plan.py's three SCALE targets (the stall from three ranks' own rounds, the bytes
    from every destination rank's fills), and DynaTrain's two claims as moves on 64 and 128
    GPUs (the paper names neither its GPUs nor its layouts: these are small worlds that hold
    the training state in 80 GB GPUs), with every rank's rounds and the bytes checked."""
    from megatron_ext.parallel.layout import ParallelLayout as L
    from rank_plan import LLAMA_70B, QWEN3_235B, SCALE

    scale_cases = list(SCALE.items())[:3]
    papers = ("70b", None, "235b_moe")
    out = [ReshardCase(name, model, a, b, target, paper)
           for (name, (model, a, b, target)), paper in zip(scale_cases, papers)]
    out.append(ReshardCase("DynaTrain 70B: tp8·pp8 -> tp8·pp4·dp2 (64 ranks)", LLAMA_70B, L(tp=8, pp=8),
                           L(tp=8, pp=4, dp=2), None, "70b", stall_ranks="all"))
    out.append(ReshardCase("DynaTrain 235B MoE: pp8·dp16 ep8 -> ep16 (128 ranks)", QWEN3_235B,
                           L(pp=8, dp=16, ep=8, first_stage_layers=11, last_stage_layers=11),
                           L(pp=8, dp=16, ep=16, first_stage_layers=11, last_stage_layers=11), None, "235b_moe",
                           stall_ranks="all"))
    return tuple(out)


def rank_traffic(model, a, b, ranks: Sequence[int], budget: int) -> tuple[list, dict]:
    """The simulator's rounds, from the ranks' own plans only (no world plan): each of `ranks`
    plans itself (`plan.rank_plan`) and cuts its own rounds (`execute.rank_rounds`), which need
    the Traffic of that rank and of its peers only (a pair's capacity is a share of its two
    ends' budgets), so each peer's Traffic comes from that peer's own plan too. Round k of the
    result holds the k-th round of every one of `ranks` (a transfer between two of them once).
    A round's simulated time is its slowest rank's work, and a rank's work depends only on its
    own sends and receives in that round, so with every rank this is the world simulation; with
    a sample it is a lower bound, exact when each round's slowest rank is in the sample."""
    from megatron_ext.reshard.execute import Traffic, rank_rounds, traffic
    from megatron_ext.reshard.plan import rank_plan
    from megatron_ext.reshard.simulate import traffic_from_rounds

    plans: dict[int, Any] = {}

    def plan_of(rank: int):
        if rank not in plans:
            plans[rank] = rank_plan(model, a, b, rank)
        return plans[rank]

    world = max(a.world, b.world)
    everyone = [Traffic(0, 0, 0, 0)] * world  # zero floors pass the budget check; only peers are read
    for peer in sorted({end for rank in ranks for op in plan_of(rank).ops for end in (op.src, op.dst)}):
        everyone[peer] = traffic(plan_of(peer), peer)
    merged: list[dict] = []
    for rank in ranks:
        for k, step in enumerate(traffic_from_rounds(rank_rounds(plans[rank], rank, budget, everyone))):
            while len(merged) <= k:
                merged.append({})
            for t in step:
                merged[k][t.src, t.dst] = t
    peers = len(plans) - len(ranks)
    return [tuple(r.values()) for r in merged], {"ranks_simulated": len(ranks), "peers_planned_for_traffic": peers}


def held_and_state(model, layout) -> tuple[dict[int, int], int]:
    """Bytes each rank holds in `layout`, and the whole training state's bytes (each element
    once, `simulate.state_bytes`), rank by rank so that no world of pieces is kept."""
    from megatron_ext.reshard import vps
    from megatron_ext.reshard.simulate import state_bytes
    from megatron_ext.reshard.skeleton import standalone_world

    key = vps.model_key(model)
    held: dict[int, int] = {}

    def pieces():
        for rank in range(layout.active):
            mine = vps._rank_pieces(key, layout, rank)
            held[rank] = sum(p.nbytes for p in mine)
            yield from mine

    with standalone_world():
        state = state_bytes(pieces())
    vps._rank_pieces.cache_clear()
    return held, state


def _reshard_case(case: ReshardCase) -> dict:
    from megatron_ext.reshard.plan_scale import measure_rank_plan, moved_bytes
    from megatron_ext.reshard.simulate import H100_CLASS, checkpoint_route, stall

    timing = measure_rank_plan(case.model, case.a, case.b)
    cpu = time.process_time()
    world = max(case.a.world, case.b.world)
    # A peer's Traffic costs a plan of its own (about 0.25 s CPU at 405B x 16,384, 25 peers a rank), so
    # at scale the stall is priced from the ranks holding the embedding and the output layer and
    # the slowest planner.
    ends = {0, case.a.active - 1, case.b.active - 1, timing["slowest_rank"]}
    ranks = range(world) if case.stall_ranks == "all" else sorted(ends)
    steps, coverage = rank_traffic(case.model, case.a, case.b, list(ranks), RESHARD_BUDGET_BYTES)
    live = stall(steps, H100_CLASS, world=world)
    held_a, state = held_and_state(case.model, case.a)
    held_b, _ = held_and_state(case.model, case.b)
    route = checkpoint_route(held_a, held_b, state, H100_CLASS)
    sim_s = time.process_time() - cpu
    # every destination rank's fills: 9 s CPU at 70B x 1,024 ranks, 67 s at 405B x 16,384, 101 s
    # for the 235B MoE at 1,024
    cpu = time.process_time()
    moved = {**moved_bytes(case.model, case.a, case.b), "cpu_s": time.process_time() - cpu}
    return {"timing": timing, "stall": dataclasses.asdict(live), "stall_total_s": live.total, "rounds": len(steps),
            "coverage": coverage, "route": dataclasses.asdict(route), "route_total_s": route.total,
            "state_bytes": state, "max_held_a": max(held_a.values()), "max_held_b": max(held_b.values()),
            "simulate_cpu_s": sim_s, "moved": moved}


def reshard_rows(cases: Optional[Sequence[ReshardCase]] = None, fresh: bool = True) -> list[dict]:
    """Per move: the slowest sampled rank's own plan (`plan_scale.measure_rank_plan`: seconds
    and peak RSS, skeleton builds of B included), bytes moved against the minimum
    (`plan_scale.moved_bytes`, every destination rank's fills; not checked where a case says
    so), the live stall on `H100_CLASS` from the ranks' own rounds (`rank_traffic`) and the
    checkpoint route's, with the layout built ahead (the switch installs it)."""
    from megatron_ext.reshard.simulate import H100_CLASS, describe

    rows = []
    for case in cases if cases is not None else reshard_cases():
        r, rss = measured(_reshard_case, case, fresh=fresh)
        t = r["timing"]
        moved = r["moved"]
        met_time = case.target_s is None or t["seconds"] <= case.target_s
        met_cpu_time = case.target_s is None or t["cpu_seconds"] <= case.target_s
        met_bytes = moved["network_bytes"] == moved["min_bytes"]
        rows.append({
            "plugin": "reshard", "case": case.name,
            # each the slowest sampled rank's by its own measure: the wall clock counts the load
            "planner_wall_s": t["seconds"], "planner_cpu_s": t["cpu_seconds"],
            "planner_peak_rss_mb": t["peak_rss_mb"], "import_rss_mb": t["import_rss_mb"],
            "planner_added_rss_mb": t["planner_added_mb"], "slowest_rank": t["slowest_rank"],
            "slowest_rank_cpu": t["slowest_rank_cpu"], "ranks_timed": len(t["ranks"]), **_measures(rss),
            "bytes": {"network_bytes": moved["network_bytes"], "min_bytes": moved["min_bytes"], "equal_min": met_bytes,
                      "how": f"plan_scale.moved_bytes: every destination rank's fills, exact ({moved['cpu_s']:.0f} s CPU)"},
            "simulated": {
                "cluster": H100_CLASS.name, "budget_bytes_per_round": RESHARD_BUDGET_BYTES,
                "stall": r["stall"], "stall_s": r["stall_total_s"], "rounds": r["rounds"],
                "ranks": ("every rank" if case.stall_ranks == "all" else
                          "the first and last rank of A and B and the slowest planner, with their peers' Traffic: "
                          "a lower bound of the world's transfer"), **r["coverage"],
                "checkpoint_route": r["route"], "checkpoint_route_s": r["route_total_s"],
                "route_over_stall": r["route_total_s"] / r["stall_total_s"],
                "state_bytes": r["state_bytes"], "max_held_bytes_a": r["max_held_a"],
                "max_held_bytes_b": r["max_held_b"], "simulate_cpu_s": r["simulate_cpu_s"],
            },
            "target": (f"slowest rank's plan <= {case.target_s:g} s and <= {RESHARD_RSS_TARGET_MB} MB, bytes = minimum"
                       if case.target_s is not None else "bytes = minimum; the simulated stall beside the paper's"),
            "met": met_time and met_bytes and (case.target_s is None or t["peak_rss_mb"] <= RESHARD_RSS_TARGET_MB),
            "met_cpu": met_cpu_time and met_bytes,
            "paper": RESHARD_PAPER[case.paper] if case.paper else
                     {"figure": None, "source": "issue 27's target (DynaTrain gives no 405B figure)"},
            "setup": {"a": str(case.a), "b": str(case.b), "world": max(case.a.world, case.b.world),
                      "model": case.model.name, "cluster": describe(H100_CLASS)},
        })
        row = rows[-1]
        checked = "= min" if met_bytes else "!= min"
        print(f"reshard {case.name}: plan {t['seconds']:.2f} s ({t['cpu_seconds']:.2f} s CPU), "
              f"{t['peak_rss_mb']:.0f} MB ({t['planner_added_mb']:.0f} MB the planner's), bytes {checked} "
              f"({row['bytes']['network_bytes']}), stall {r['stall_total_s']:.2f} s "
              f"({r['rounds']} rounds), checkpoint route {r['route_total_s']:.1f} s "
              f"({row['simulated']['route_over_stall']:.0f}x)", flush=True)
    return rows


# --- the table ---------------------------------------------------------------------------------

ROWS: dict[str, Callable[[], list[dict]]] = {"dpp": dpp_rows, "lora": lora_rows, "reshard": reshard_rows}


def _limit(row: dict) -> float:
    """The time a row's planner must stay under, for the plot."""
    if row["plugin"] == "dpp":
        return row["simulated"]["iter_s"]
    if row["plugin"] == "reshard":
        target = re.match(r"slowest rank's plan <= ([0-9.]+) s", row["target"])
        return float(target.group(1)) if target else row["paper"]["stall_s"]
    return 60.0


def plot(rows: Sequence[dict], path: str) -> None:
    """Per row, the planner's wall and CPU time beside the time it must stay under (dpp: the
    simulated iteration; lora: the 60 s limit; reshard: the plan time target, or where there is
    none the paper's stall, with the simulated stall and checkpoint route written above), on a
    log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(rows)), 4))
    x = range(len(rows))
    limits = [_limit(r) for r in rows]
    ax.bar([i - 0.27 for i in x], [r["planner_wall_s"] for r in rows], 0.27, label="planner wall time (this machine)")
    ax.bar(list(x), [r["planner_cpu_s"] for r in rows], 0.27, color="tab:green", label="planner CPU time")
    ax.bar([i + 0.27 for i in x], limits, 0.27, color="tab:gray",
           label="dpp: simulated iteration; lora: 60 s limit; reshard: plan target (or the paper's stall)")
    for i, r in enumerate(rows):
        if r["plugin"] == "lora":
            ratios = [v for v in r["simulated"]["baseline_over_planner"].values() if v is not None]
            ax.annotate(f"best baseline's makespan:\n{min(ratios):.2f}x the planner's", (i, limits[i]), ha="center",
                        va="bottom", fontsize=7)
        if r["plugin"] == "reshard":
            sim = r["simulated"]
            ax.annotate(f"stall {sim['stall_s']:.2f} s\nckpt {sim['checkpoint_route_s']:.0f} s", (i, limits[i]),
                        ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("seconds")
    ax.set_xticks(list(x))
    ax.set_xticklabels([r["case"].split(",")[0] for r in rows], rotation=20, ha="right", fontsize=7)
    ax.set_title(f"planners at cluster scale ({CLUSTER['name']}: {CLUSTER['gpu']})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--plot")
    p.add_argument("--plugins", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--update", action="store_true",
                   help="keep the other plugins' rows of the JSON already at --json, replacing only those of --plugins")
    args = p.parse_args(argv)
    require(__file__, {"matplotlib": "--plot" if args.plot else None})
    rows = [row for plugin in args.plugins for row in ROWS[plugin]()]
    if args.update and Path(args.json).exists():
        kept = [r for r in json.loads(Path(args.json).read_text())["rows"] if r["plugin"] not in args.plugins]
        rows = sorted(kept + rows, key=lambda r: list(ROWS).index(r["plugin"]) if r["plugin"] in ROWS else len(ROWS))
    out = {"cluster": CLUSTER, "machine": "2 CPU cores shared with other work (each row has the load average)", "rows": rows,
           "provenance": provenance(__file__, argv)}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
