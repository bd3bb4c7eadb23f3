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
        "source": "/work/shared/reference/dpp.md section 2 (Accuracy and overhead)",
    },
    "lora": {
        "figure": "up to 7.52x lower sweep makespan than existing approaches (PLoRA abstract, arXiv 2508.02932)",
        "makespan_reduction_max": 7.52,
        "source": "/work/shared/reference/plora.md section 0 and 1.7; /work/shared/seeds/000_e9d28edf31e35b50.txt",
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
    from megatron_ext.dpp.costmodel import ModelShape

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
    from megatron_ext.dpp.costmodel import analytic_gpu

    cost = analytic_gpu(shape, peak_flops=tp * cluster["peak_bf16_flops"], mfu=cluster["dpp_mfu"],
                        t0=cluster["dpp_t0_tokens"], p2p_bytes_s=tp * cluster["ib_bytes_per_s"], zero_shards=dp)
    per_gpu = ("act_bytes_token", "act_bytes_key", "ckpt_bytes_token", "kv_bytes_token", "head_bytes_token",
               "state_bytes_param")
    return dataclasses.replace(cost, **{f: getattr(cost, f) / tp for f in per_gpu})


def global_batch(case: DppCase, seed: int) -> list[int]:
    """Sequence lengths drawn from the scaled GitHub fit, each cut at `max_len`, as many as fit
    in `batch_tokens` tokens."""
    import numpy as np

    from megatron_ext.dpp.lengths import GITHUB, LogNormal

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
    from megatron_ext.dpp.batch import dp_share
    from megatron_ext.dpp.planner import plan_step_info

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
    from megatron_ext.lora.costmodel import GpuSpec

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
    from megatron_ext.lora import planner
    from megatron_ext.lora.costmodel import GpuCostModel
    from megatron_ext.lora.memory import BF16, Hardware, MemoryModel
    from megatron_ext.lora.workload import shapes_of

    model = ModelConfig(name="llama3_8b", num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
                        num_attention_heads=32, num_query_groups=8, vocab_size=128256, tie_embeddings=False,
                        seq_length=max(SEQ_LENGTHS))
    shapes = shapes_of(model)
    hardware = Hardware(devices=case.devices, memory_bytes=CLUSTER["gpu_memory_bytes"], reserve_bytes=4 * 10**9)
    return planner.Problem(tuple(lora_jobs(case)), hardware, MemoryModel(shapes, BF16), GpuCostModel(shapes, lora_gpu()),
                           max_tp=CLUSTER["gpus_per_node"])


def _plan_lora_case(case: LoraCase) -> dict:
    from megatron_ext.lora import planner
    from megatron_ext.lora.simulate import simulate

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


# --- the table ---------------------------------------------------------------------------------

ROWS: dict[str, Callable[[], list[dict]]] = {"dpp": dpp_rows, "lora": lora_rows}


def plot(rows: Sequence[dict], path: str) -> None:
    """Per row, the planner's wall and CPU time beside the time it must stay under (dpp: the
    simulated iteration; lora: the 60 s limit), on a log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(rows)), 4))
    x = range(len(rows))
    limits = [r["simulated"]["iter_s"] if r["plugin"] == "dpp" else 60.0 for r in rows]
    ax.bar([i - 0.27 for i in x], [r["planner_wall_s"] for r in rows], 0.27, label="planner wall time (this machine)")
    ax.bar(list(x), [r["planner_cpu_s"] for r in rows], 0.27, color="tab:green", label="planner CPU time")
    ax.bar([i + 0.27 for i in x], limits, 0.27, color="tab:gray", label="dpp: simulated iteration; lora: 60 s limit")
    for i, r in enumerate(rows):
        if r["plugin"] == "lora":
            ratios = [v for v in r["simulated"]["baseline_over_planner"].values() if v is not None]
            ax.annotate(f"best baseline's makespan:\n{min(ratios):.2f}x the planner's", (i, limits[i]), ha="center",
                        va="bottom", fontsize=7)
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
    rows = [row for plugin in args.plugins for row in ROWS[plugin]()]
    if args.update and Path(args.json).exists():
        kept = [r for r in json.loads(Path(args.json).read_text())["rows"] if r["plugin"] not in args.plugins]
        rows = sorted(kept + rows, key=lambda r: list(ROWS).index(r["plugin"]) if r["plugin"] in ROWS else len(ROWS))
    out = {"cluster": CLUSTER, "machine": "2 CPU cores shared with other work (each row has the load average)", "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
