"""DPP plan-ahead benchmark: real PP=2 steps on 2 CPU workers, planning ahead against planning
at each step, on the same global batches and the same plans.

    python scripts/bench/dpp_plan_ahead.py --json scripts/bench/results/dpp_plan_ahead.json \
        --plot scripts/bench/results/dpp_plan_ahead.png

The model, corpus, batches and cost model are those of dpp_measured.py: the llama_tiny preset
(byte tokenizer) on the default corpus, global batches of `--docs` real-text prefixes whose
lengths follow `--dist` truncated at `--max-seq-len` (dpp_measured.skewed_batches), the time
terms of a calibrated cost model (`--cost-model`, by default the one dpp_measured.py wrote; no
calibration is run here) with its activation terms refitted to this run (fit_activation_bytes).
The activation budget per stage is `--budget-fraction` of what the batches need without any
recompute (or `--act-budget-mb`), so the recompute ILP binds and planning takes long.

Two arms run the DPP policy: `ahead` (PlanAhead(ahead=True): batch i + 1 is read and solved in
a background thread of the first stage while step i trains) and `at_step` (ahead=False: each
batch is solved when its step asks for it). The stream of batches is cut into `--blocks`
segments of `--steps` batches; both arms run every segment, in the order AB BA AB BA ... so that
other load on the machine hits both alike. Each arm's run of a segment is a fresh PlanAhead on
the segment's first batch, closed at its end after the plan being solved ahead (of the next,
unused batch) is finished, so no background planning overlaps the other arm's steps.
The optimizer step is left out (it is the same for both arms) and so the weights do not change:
both arms train the same weights on the same batches.

A step is what the training loop sees, timed on every rank between two barriers: waiting for
the plan (`next(stream)`: the solve not yet done, plus `agree`, the plan's broadcast to stage 1)
and the DppStep call (forward-backward, gradient reduction). Per arm: step_s (median over the
steady-state steps, each block's first step left out: nothing was planned ahead for it; its
numbers are reported apart), wait_s (median wait on stage 0, the stage that plans),
forward_backward_s, and the planner's solve per batch, timed inside the solving thread by a
wrapper of the StepPlanner: wall seconds and that thread's CPU seconds (time.thread_time; the
process's CPU time is not separable from training while planning ahead). speedup is at_step's
median step over ahead's; speedup_per_batch(_median) the same ratio batch by batch (both arms'
steady-state steps are the same batches), speedup_total the ratio of the summed step times. plans_identical says whether both arms got the same plan for every
batch (the recompute ILP has a wall-clock time limit, so a loaded machine could change a plan).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(HERE)]

from dpp_measured import activation_need, build, global_batches, step_planner  # noqa: E402  (its model, batches, budgets)
from extras import require  # noqa: E402  (scripts/bench/extras.py, beside this script)
from provenance import provenance  # noqa: E402  (scripts/bench/provenance.py, beside this script)

ARMS = ("ahead", "at_step")
DEFAULT_COST_MODEL = HERE / "results" / "dpp_measured_median.costmodel.json"


# --- the planner, timed in whichever thread solves ---------------------------------------------


class TimedPlanner:
    """A StepPlanner whose `solve` calls are timed in the thread that runs them: wall seconds,
    that thread's CPU seconds and the process's CPU seconds (all threads) per solve, in order."""

    def __init__(self, planner: Any) -> None:
        self.planner = planner
        self.solves: list[dict] = []
        self._lock = threading.Lock()

    def solve(self, batch: list) -> Any:
        wall, cpu, proc = time.perf_counter(), time.thread_time(), time.process_time()
        solved = self.planner.solve(batch)
        record = dict(wall_s=time.perf_counter() - wall, thread_cpu_s=time.thread_time() - cpu,
                      process_cpu_s=time.process_time() - proc, thread=threading.current_thread().name)
        with self._lock:
            self.solves.append(record)
        return solved

    def agree(self, batch: list, solved: Any) -> Any:
        return self.planner.agree(batch, solved)


# --- worker: one rank of the PP=2 run ----------------------------------------------------------


def segment(batches: list[list], start: int, count: int) -> Iterator[tuple[list, int]]:
    """Batches start .. start + count - 1 of the stream, each with the index of the next one
    (PlanAhead's stream position)."""
    for i in range(start, start + count):
        yield batches[i], i + 1


class Runner:
    """Runs blocks of steps of one arm on this rank and keeps their timings and plans."""

    def __init__(self, trainer: Any, plugin: Any, batches: list[list], planner: Any) -> None:
        import torch.distributed as dist
        from megatron_ext.dpp.runtime.loop import DppStep
        from megatron_ext.training.step import forward_step

        self.trainer, self.batches, self.planner = trainer, batches, planner
        self.dist, self.forward_step = dist, forward_step
        self.step = DppStep(plugin.context)
        self.steps: list[dict] = []
        self.solves: list[dict] = []
        self.plans: dict[tuple[str, int], Any] = {}

    def block(self, arm: str, block: int, start: int, count: int) -> None:
        """`count` steps of `arm` from batch `start`: a fresh PlanAhead, built inside the first
        step's timing (its wait is the whole first solve in both arms), closed once the solve
        of the next, unused batch (planning ahead only) is done."""
        timed = TimedPlanner(self.planner)
        # One batch more than the block trains: the last step plans the next one ahead, as in a run.
        batches = segment(self.batches, start, count + 1)
        stream: Optional[Any] = None
        for j in range(count):
            stream = self._one(arm, block, start + j, j, stream, timed, batches)
        while arm == "ahead" and not stream.ready():
            time.sleep(0.005)
        stream.close()
        for i, solve in enumerate(timed.solves):
            solve.update(arm=arm, block=block, batch=start + i, trained=i < count)
        self.solves += timed.solves

    def _one(self, arm: str, block: int, batch: int, j: int, stream: Optional[Any], timed: TimedPlanner,
             batches: Iterator) -> Any:
        from megatron_ext.dpp.runtime.ahead import PlanAhead

        for m in self.trainer.model:
            m.zero_grad_buffer()
        self.dist.barrier()
        began = time.perf_counter()
        if stream is None:
            stream = PlanAhead(batches, timed, ahead=arm == "ahead")
        planned = next(stream)
        planned_at = time.perf_counter()
        self.step(planned, self.forward_step, self.trainer.model)
        self.dist.barrier()
        ended = time.perf_counter()
        self.plans[(arm, batch)] = planned.plan
        self.steps.append(dict(arm=arm, block=block, batch=batch, index_in_block=j, first=j == 0,
                               step_s=ended - began, wait_s=planned_at - began, forward_backward_s=ended - planned_at,
                               tokens=stream.tokens))
        return stream


def schedule(blocks: int) -> list[tuple[str, int]]:
    """(arm, segment) in run order: AB BA AB BA ..., every segment run by both arms."""
    out = []
    for k in range(blocks):
        order = ARMS if k % 2 == 0 else ARMS[::-1]
        out += [(arm, k) for arm in order]
    return out


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from megatron_ext.dpp.planning.costmodel import CostModel
    from megatron_ext.dpp.runtime.memory import fit_activation_bytes

    trainer, plugin, dataset = build(args)
    rank, layers = dist.get_rank(), trainer.cfg.model.num_layers
    # One batch past the last segment: the last block planning ahead solves it (unused).
    batches = global_batches(dataset, args, args.blocks * args.steps + 1)
    cost, fit = fit_activation_bytes(trainer.model, plugin.context, CostModel.from_json(args.cost_model))
    need = activation_need(args, cost, layers, batches)
    act_budget = args.act_budget_mb * 2**20 if args.act_budget_mb else args.budget_fraction * need
    runner = Runner(trainer, plugin, batches, step_planner(args, cost, layers, "dpp", act_budget))
    runner.block("at_step", -1, 0, 1)  # warm-up, untimed: the first step of a process is slower
    runner.steps.clear(), runner.solves.clear(), runner.plans.clear()
    for arm, k in schedule(args.blocks):
        runner.block(arm, k, k * args.steps, args.steps)
        if rank == 0:
            last = runner.steps[-args.steps:]
            print(f"block {k} {arm:8s} steps " + " ".join(f"{s['step_s']:.2f}" for s in last)
                  + "  waits " + " ".join(f"{s['wait_s']:.2f}" for s in last), flush=True)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(rank=rank, steps=runner.steps, solves=runner.solves))
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps(dict(
            ranks=gathered, plans_identical=plans_identical(runner.plans), act_budget_bytes=act_budget,
            act_need_bytes=need, memory_fit=fit, lengths=[[len(d) - 1 for d in b] for b in batches],
            predicted_iter_s=predicted(runner.plans, cost, layers))))
    trainer.close()
    dist.destroy_process_group()


def plans_identical(plans: dict[tuple[str, int], Any]) -> dict:
    """Whether both arms ran the same plan for every batch."""
    batches = sorted({b for _, b in plans})
    differ = [b for b in batches if plans.get(("ahead", b)) != plans.get(("at_step", b))]
    return dict(all=not differ, batches_differing=differ)


def predicted(plans: dict[tuple[str, int], Any], cost: Any, layers: int) -> dict[int, float]:
    """The simulator's step time of each batch's plan (planning at each step)."""
    from megatron_ext.dpp.planning.costmodel import stage_layers
    from megatron_ext.dpp.planning.simulate import simulate

    per_stage = stage_layers(layers, 2)
    return {b: simulate(p, cost, per_stage).iter_s for (arm, b), p in plans.items() if arm == "at_step"}


# --- driver ---------------------------------------------------------------------------------


def launch(args: argparse.Namespace) -> dict:
    """Run the two PP=2 workers; return rank 0's raw record."""
    out = Path(args.json).with_suffix(".worker.json")
    command = [sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               __file__, "--worker-out", str(out), "--json", args.json, "--cost-model", args.cost_model,
               "--model", args.model, "--max-seq-len", str(args.max_seq_len), "--dist", args.dist,
               "--docs", str(args.docs), "--blocks", str(args.blocks), "--steps", str(args.steps),
               "--seed", str(args.seed), "--budget-fraction", str(args.budget_fraction),
               "--act-budget-mb", str(args.act_budget_mb)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    subprocess.run(command, check=True, cwd=REPO, env=env)
    raw = json.loads(out.read_text())
    out.unlink()
    return raw


def _shown(path: str) -> str:
    """`path` relative to the repository when it is inside it (results name no machine's paths)."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else str(path)


def _median(values: list[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def arm_record(arm: str, steps: list[dict], solves: list[dict]) -> dict:
    """One arm's numbers (stage 0's timings; its steps are bounded by barriers, so stage 1's
    step times are the same to a few milliseconds and are kept in `steps_stage1`)."""
    mine = sorted((s for s in steps if s["arm"] == arm), key=lambda s: s["batch"])
    steady = [s for s in mine if not s["first"]]
    first = [s for s in mine if s["first"]]
    trained = [s for s in solves if s["arm"] == arm and s["trained"]]
    return dict(
        step_s=_median([s["step_s"] for s in steady]), step_s_all=[s["step_s"] for s in steady],
        wait_s=_median([s["wait_s"] for s in steady]), wait_s_all=[s["wait_s"] for s in steady],
        forward_backward_s=_median([s["forward_backward_s"] for s in steady]),
        forward_backward_s_all=[s["forward_backward_s"] for s in steady],
        batches=[s["batch"] for s in steady],
        first_step_s=[s["step_s"] for s in first], first_wait_s=[s["wait_s"] for s in first],
        first_forward_backward_s=[s["forward_backward_s"] for s in first],
        planning_wall_s=_median([s["wall_s"] for s in trained]),
        planning_wall_s_all=[s["wall_s"] for s in trained],
        planning_thread_cpu_s=_median([s["thread_cpu_s"] for s in trained]),
        planning_thread_cpu_s_all=[s["thread_cpu_s"] for s in trained],
        planning_process_cpu_s_all=[s["process_cpu_s"] for s in trained],
        planning_threads=sorted({s["thread"] for s in trained}),
        tokens_per_step=_median([s["tokens"] for s in steady]),
    )


def summarize(raw: dict, args: argparse.Namespace) -> dict:
    by_rank = {r["rank"]: r for r in raw["ranks"]}
    steps, solves = by_rank[0]["steps"], by_rank[0]["solves"]
    arms = {arm: arm_record(arm, steps, solves) for arm in ARMS}
    for arm in ARMS:
        arms[arm]["steps_stage1"] = [s for s in by_rank[1]["steps"] if s["arm"] == arm]
    ahead, at_step = arms["ahead"], arms["at_step"]
    paired = [b / a for a, b in zip(ahead["step_s_all"], at_step["step_s_all"])]  # same batches, same order
    return dict(
        config=dict(model=args.model, dist=args.dist, docs_per_batch=args.docs, max_seq_len=args.max_seq_len,
                    budget_fraction=None if args.act_budget_mb else args.budget_fraction,
                    act_budget_bytes=raw["act_budget_bytes"], act_need_bytes=raw["act_need_bytes"],
                    blocks=args.blocks, steps_per_block=args.steps, order=[f"{a}:{k}" for a, k in schedule(args.blocks)],
                    cost_model=_shown(args.cost_model), seed=args.seed, pp=2, optimizer_step="excluded"),
        arms=arms,
        speedup=at_step["step_s"] / ahead["step_s"],
        speedup_per_batch=paired, speedup_per_batch_median=_median(paired),
        speedup_total=sum(at_step["step_s_all"]) / sum(ahead["step_s_all"]),
        planning_over_forward_backward=at_step["planning_wall_s"] / at_step["forward_backward_s"],
        plans_identical=raw["plans_identical"],
        steps=steps, solves=solves, lengths=raw["lengths"], predicted_iter_s=raw["predicted_iter_s"],
        memory_fit=raw["memory_fit"],
    )


def plot(path: str, result: dict) -> None:
    """Per-step times of both arms by batch (first steps of blocks hollow), and their waits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for arm, colour in zip(ARMS, ("tab:blue", "tab:orange")):
        mine = [s for s in result["steps"] if s["arm"] == arm]
        for first, face in ((False, colour), (True, "none")):
            sel = [s for s in mine if s["first"] == first]
            label = f"{arm}" + (" (block's first step)" if first else f": median {result['arms'][arm]['step_s']:.2f} s")
            top.scatter([s["batch"] for s in sel], [s["step_s"] for s in sel], facecolors=face, edgecolors=colour, label=label)
            bottom.scatter([s["batch"] for s in sel], [s["wait_s"] for s in sel], facecolors=face, edgecolors=colour)
    solves = [s for s in result["solves"] if s["arm"] == "at_step" and s["trained"]]
    bottom.plot([s["batch"] for s in solves], [s["wall_s"] for s in solves], "k_", ms=12, label="solve wall (at_step)")
    for k in range(1, result["config"]["blocks"]):
        for ax in (top, bottom):
            ax.axvline(k * result["config"]["steps_per_block"] - 0.5, color="grey", lw=0.5)
    c = result["config"]
    top.set_title(f"DPP plan ahead vs at each step, PP=2 on 2 CPU workers ({c['docs_per_batch']} docs, context "
                  f"{c['max_seq_len']}): speed-up {result['speedup']:.3f}")
    top.set_ylabel("step (wait + forward-backward) s")
    bottom.set_ylabel("wait for plan s")
    bottom.set_xlabel("global batch")
    top.legend(fontsize=8)
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True)
    ap.add_argument("--plot", default=None, help="PNG: per-step times and waits of both arms")
    ap.add_argument("--cost-model", default=str(DEFAULT_COST_MODEL),
                    help="a calibrate.py JSON (its activation terms are refitted here)")
    ap.add_argument("--model", default="llama_tiny")
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--dist", default="github", help="as dpp_measured.py: a length distribution or 'corpus'")
    ap.add_argument("--docs", type=int, default=8, help="documents per global batch")
    ap.add_argument("--blocks", type=int, default=4, help="segments of the stream, each run by both arms (ABBA)")
    ap.add_argument("--steps", type=int, default=6, help="steps per block (the first one is reported apart)")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--budget-fraction", type=float, default=0.25,
                    help="activation budget per stage, as a fraction of what the batches need without recompute")
    ap.add_argument("--act-budget-mb", type=float, default=0.0, help="explicit activation budget per stage")
    ap.add_argument("--worker-out", default=None)
    args = ap.parse_args()
    if args.worker_out:
        worker(args)
        return
    require(__file__, {"matplotlib": "--plot" if args.plot else None})
    if not Path(args.cost_model).exists():
        sys.exit(f"{args.cost_model}: no such cost model (python -m megatron_ext.dpp.tools.calibrate --out FILE writes one)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    result = {**summarize(launch(args), args), "provenance": provenance(__file__)}
    Path(args.json).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(args.plot, result)
    keys = ("step_s", "wait_s", "forward_backward_s", "planning_wall_s", "planning_thread_cpu_s", "first_step_s")
    print(json.dumps({arm: {k: result["arms"][arm][k] for k in keys} for arm in ARMS}, indent=1))
    print(f"speed-up (at_step / ahead): median step {result['speedup']:.3f}, per batch (median) "
          f"{result['speedup_per_batch_median']:.3f}, total {result['speedup_total']:.3f}; "
          f"plans identical: {result['plans_identical']['all']}")


if __name__ == "__main__":
    main()
