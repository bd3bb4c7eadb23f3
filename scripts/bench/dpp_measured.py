"""DPP measured benchmark: real PP=2 steps on 2 CPU workers, every policy on the same batches.

    python scripts/bench/dpp_measured.py --json scripts/bench/results/dpp_measured.json

A LLaMA-style model (the llama_tiny preset, byte tokenizer) trains on real text of the default
corpus (the Python standard library). Its byte-tokenised files are mostly longer than a CPU-sized
context, so by default each global batch draws its lengths from the reference's GitHub-like
lognormal truncated at `--max-seq-len` and takes each as the prefix of a real document
(`--dist corpus`: whole documents as they are, truncated). The time terms of
the cost model come from `megatron_ext.dpp.tools.calibrate` (megatron layers timed on this machine,
then what a real PP=2 step adds to them: `dpp/tools/overhead.py`);
its activation-memory terms are fitted here, per stage, from single-chunk forwards of the
real stage models counted by the runtime's meter (no pipeline, other chunk sizes than the
benchmark's; its attention backward on bare segments), so that `predicted_act_bytes` is a
prediction, not a replay. Every policy plans the same global batches under the same per-stage
budget; each runs them through the DPP runtime (megatron's p2p, DDP, block recompute). After one
untimed warm-up step per policy, the batches run one after another, and every policy runs each
batch in turn (round-robin, the order rotated per batch), so that other load on the machine
hits all policies alike. A record: policy, iter_s (median over the batches of a step's
forward-backward, the optimizer step excluded: it is the same for every policy; iter_s_all the
steps in batch order; predicted_iter_s(_all) the simulator's, median and per batch),
peak_act_bytes (max over stages and steps, counted exactly with saved-tensor hooks; per stage
and per batch too), budget_bytes (activations),
predicted_act_bytes (the planner's cost model for the same plans), act_bytes_error (the largest
|predicted / measured - 1| over stages and batches).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
import statistics
import subprocess
import sys
import time
from pathlib import Path
from extras import require  # noqa: E402  (scripts/bench/extras.py, beside this script)
from provenance import provenance  # noqa: E402  (scripts/bench/provenance.py, beside this script)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

POLICIES = ("dpp", "packed", "split", "chunkflow", "dpp_no_balance", "dpp_no_ckpt", "dpp_full_ckpt")


# --- worker: one rank of the PP=2 run ----------------------------------------------------------


def build(args) -> tuple:
    """The PP=2 trainer (llama_tiny, seq_length 256 for the model's own buffers; DPP chunks set
    the real lengths), its DppPlugin and the run's indexed dataset."""
    from megatron_ext.config.schema import Config, ParallelConfig, TrainConfig
    from megatron_ext.config.store import MODEL_PRESETS
    from megatron_ext.dpp.plugin import DppConfig, DppPlugin, open_documents
    from megatron_ext.platform.launch import join_world
    from megatron_ext.training.trainer import Trainer

    join_world("cpu")
    model = dataclasses.replace(MODEL_PRESETS[args.model], seq_length=256)
    plugin = DppPlugin(DppConfig(max_seq_len=args.max_seq_len, docs_per_batch=args.docs, cost_model=args.cost_model))
    cfg = Config(model=model, parallel=ParallelConfig(pp=2, use_distributed_optimizer=False),
                 train=TrainConfig(iters=1, eval_interval=0), plugins=["dpp"])
    trainer = Trainer(cfg, [plugin])
    trainer.setup()
    return trainer, plugin, open_documents(trainer.plugin_context(plugin))


def global_batches(dataset, args, count: int) -> list:
    """`count` global batches (`--dist corpus`: whole documents of the seeded stream, truncated;
    else real-text prefixes of `--dist` lengths, `skewed_batches`)."""
    from megatron_ext.dpp.runtime.batch import DocumentBatches

    if args.dist == "corpus":
        documents = DocumentBatches(dataset, args.docs, args.max_seq_len, "truncate", args.seed)
        return [b for _, b in zip(range(count), documents)]
    return skewed_batches(dataset, argparse.Namespace(**{**vars(args), "batches": count}))


def stage_states(cost, num_layers: int) -> list[float]:
    from megatron_ext.dpp.planning.costmodel import stage_layers

    layers = stage_layers(num_layers, 2)
    return [cost.model_state_bytes(layers[p], p == 0, p == 1) for p in range(2)]


def step_planner(args, cost, num_layers: int, policy: str, act_budget: float):
    """A PP=2 StepPlanner of `policy` whose per-stage budget is the model states plus `act_budget`."""
    from megatron_ext.dpp.plugin import DppConfig, StepPlanner

    budget_mb = (max(stage_states(cost, num_layers)) + act_budget) / 2**20
    return StepPlanner(DppConfig(max_seq_len=args.max_seq_len, policy=policy, memory_budget_mb=budget_mb), num_layers, 2, cost)


def activation_need(args, cost, num_layers: int, batches: list) -> float:
    """What the batches' activations need per stage with no recompute (dpp_no_ckpt's plans, the
    simulator's peaks less the model states): the reference budgets are fractions of."""
    from megatron_ext.dpp.planning.costmodel import stage_layers
    from megatron_ext.dpp.planning.simulate import memory_peaks

    states = stage_states(cost, num_layers)
    free = step_planner(args, cost, num_layers, "dpp_no_ckpt", 1e15)
    peaks = (memory_peaks(free.plan(b).plan, cost, stage_layers(num_layers, 2)) for b in batches)
    return max(max(p - s for p, s in zip(peak, states)) for peak in peaks)


def worker(args) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_ext.dpp.planning.costmodel import CostModel, stage_layers
    from megatron_ext.dpp.planning.simulate import memory_peaks, simulate
    from megatron_ext.dpp.runtime.loop import DppStep
    from megatron_ext.dpp.runtime.memory import ActivationMeter, Timeline, fit_activation_bytes
    from megatron_ext.training.step import forward_step

    trainer, plugin, dataset = build(args)
    rank = dist.get_rank()
    model = trainer.cfg.model
    stage = parallel_state.get_pipeline_model_parallel_rank()
    batches = global_batches(dataset, args, args.batches)
    cost, fit = fit_activation_bytes(trainer.model, plugin.context, CostModel.from_json(args.cost_model))
    layers = list(stage_layers(model.num_layers, 2))
    states = stage_states(cost, model.num_layers)

    def planner(policy: str, act_budget: float):
        return step_planner(args, cost, model.num_layers, policy, act_budget)

    if args.act_budget_mb:
        budgets = {None: args.act_budget_mb * 2**20}
    else:  # binding: fractions of what the batches need without any recompute
        need = activation_need(args, cost, model.num_layers, batches)
        budgets = {f: f * need for f in args.budget_fractions}
    meter, timeline = ActivationMeter(trainer.model), Timeline()
    step = DppStep(plugin.context, meter, timeline)
    planned, records = {}, []  # planned: (budget fraction, policy) -> the batches' plans
    for fraction, act_budget in budgets.items():
        for policy in args.policies:
            try:
                p = planner(policy, act_budget)
                planned[(fraction, policy)] = [p.plan(b) for b in batches]
            except ValueError as refused:
                records.append(dict(policy=policy, iter_s=None, peak_act_bytes=None, budget_bytes=act_budget,
                                    budget_fraction=fraction, predicted_act_bytes=None, infeasible=True, reason=str(refused)))

    def run(key: tuple, i: int) -> tuple[float, int]:
        """One step of batch i under `key`'s plans: (seconds, this stage's activation peak)."""
        for m in trainer.model:
            m.zero_grad_buffer()
        meter.reset_peak()
        timeline.clear()
        dist.barrier()
        t = time.perf_counter()
        step(planned[key][i], forward_step, trainer.model)
        dist.barrier()
        return time.perf_counter() - t, meter.peak_bytes

    keys = list(planned)
    for key in keys:  # warm-up: every run runs batch 0 once, untimed
        run(key, 0)
    times = {key: [0.0] * len(batches) for key in keys}
    peaks = {key: [0] * len(batches) for key in keys}
    timelines = {}
    for i in range(len(batches)):
        # Round-robin, the order rotated per batch: a change of load on the machine hits every
        # policy and budget alike, and none always runs first or last.
        for key in keys[i % len(keys):] + keys[: i % len(keys)]:
            times[key][i], peaks[key][i] = run(key, i)
            if i == 0:
                timelines[key] = list(timeline.records)
            if rank == 0:
                print(f"batch {i} budget {key[0]} {key[1]:15s} {times[key][i]:6.2f}s", flush=True)
    measured = [None] * dist.get_world_size()
    dist.all_gather_object(measured, (stage, peaks))
    for (fraction, policy), plans in planned.items():
        key = (fraction, policy)
        per_batch = [[max(b[key][i] for s, b in measured if s == p) for p in range(2)] for i in range(len(batches))]
        predicted = [[memory_peaks(pb.plan, cost, layers)[p] - states[p] for p in range(2)] for pb in plans]
        per_stage = [max(b[p] for b in per_batch) for p in range(2)]
        predicted_stage = [max(b[p] for b in predicted) for p in range(2)]
        rec = dict(
            policy=policy, iter_s=statistics.median(times[key]), iter_s_all=times[key],
            predicted_iter_s=statistics.median(simulate(pb.plan, cost, layers).iter_s for pb in plans),
            predicted_iter_s_all=[simulate(pb.plan, cost, layers).iter_s for pb in plans],
            peak_act_bytes=max(per_stage), peak_act_bytes_per_stage=per_stage, peak_act_bytes_per_batch=per_batch,
            budget_bytes=budgets[fraction], budget_fraction=fraction,
            predicted_act_bytes=max(predicted_stage), predicted_act_bytes_per_stage=predicted_stage,
            predicted_act_bytes_per_batch=predicted,
            act_bytes_error=max(abs(q / m - 1) for pb, mb in zip(predicted, per_batch) for q, m in zip(pb, mb)),
            fits=all(b <= budgets[fraction] for b in per_stage), infeasible=False,
            chunks=[len(pb.plan.chunks) for pb in plans], groups=[len(pb.plan.groups) for pb in plans],
            recomputed_layers=[[sum(o.recompute for g in pb.plan.groups for o in g.ops[p]) for p in range(2)] for pb in plans],
        )
        records.append(rec)
        if rank == 0:
            print(f"budget {fraction} {policy:15s} iter {rec['iter_s']:6.2f}s  peak act {max(per_stage) / 2**20:7.1f} MiB "
                  f"(predicted {max(predicted_stage) / 2**20:7.1f}, budget {budgets[fraction] / 2**20:7.1f})", flush=True)
    first = min(budgets)  # the plot shows the tightest budget
    planned_first = {policy: plans[0].plan for (fraction, policy), plans in planned.items() if fraction == first}
    timelines = {policy: records for (fraction, policy), records in timelines.items() if fraction == first}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, timelines)
    if rank == 0:
        lengths = [[len(d) - 1 for d in b] for b in batches]
        Path(args.worker_out).write_text(json.dumps({
            "records": records, "lengths": lengths, "memory_fit": fit, "cost_model": dataclasses.asdict(cost),
            "timelines": {pol: _from_zero([r for g in gathered for r in g.get(pol, [])]) for pol in args.policies},
        }))
        if args.plot:  # drawn by the launcher, once it has written the JSON
            panels_file(args.worker_out).write_bytes(pickle.dumps(gantt_panels(planned_first, gathered, cost)))
    trainer.close()
    dist.destroy_process_group()


def skewed_batches(dataset, args) -> list:
    """Global batches whose lengths follow a length distribution of the reference (`--dist`,
    truncated at the context): each length is the prefix of a real document at least that
    long, so the tokens are real text."""
    import numpy as np
    import torch

    from megatron_ext.dpp.planning.lengths import get_distribution, sample_batch

    rng = np.random.default_rng(args.seed)
    order = iter(np.random.default_rng(args.seed + 1).permutation(len(dataset)).tolist() * 1000)
    batches = []
    for _ in range(args.batches):
        lengths = sample_batch(get_distribution(args.dist), args.docs, args.max_seq_len, rng).lengths
        docs = []
        for n in lengths:
            doc = np.asarray(dataset[next(order)])
            while len(doc) < n + 1:
                doc = np.asarray(dataset[next(order)])
            docs.append(torch.from_numpy(doc[: n + 1].astype(np.int64)))
        batches.append(docs)
    return batches


def panels_file(worker_out: str | Path) -> Path:
    return Path(worker_out).with_suffix(".panels.pkl")


def gantt_panels(planned: dict, timelines: list, cost) -> list:
    """The Gantt panels (gantt.save's) of the measured first step of dpp and of the static policies."""
    from megatron_ext.dpp.planning.gantt import TimedOp

    panels = []
    for policy in ("dpp", "packed", "split", "chunkflow"):
        if policy not in planned:
            continue
        plan = planned[policy]
        records = _from_zero([r for g in timelines for r in g.get(policy, [])])
        ops = [TimedOp(st, kind, c, a, b, r * cost.layer_forward_s(plan.chunks[c]) if kind == "B" else 0.0)
               for st, kind, c, r, a, b in records]
        end = max(o.end for o in ops)
        panels.append((ops, plan, f"{policy} (measured, PP=2 on CPU): step {end:.1f}s"))
    return panels


def _from_zero(records: list) -> list:
    origin = min((r[4] for r in records), default=0.0)
    return [(*r[:4], r[4] - origin, r[5] - origin) for r in records]


# --- driver ---------------------------------------------------------------------------------


def summary(records: list[dict]) -> dict:
    """The issue's targets for each budget: DPP against the fastest static policy that fits it
    (medians over the batches, and batch by batch); and the cost model's largest activation
    error over every run."""
    out = {}
    for fraction in dict.fromkeys(r["budget_fraction"] for r in records):
        mine = [r for r in records if r["budget_fraction"] == fraction]
        ok = {r["policy"]: r for r in mine if not r["infeasible"] and r["fits"]}
        static = [r for p, r in ok.items() if p in ("packed", "split", "chunkflow")]
        got = {"budget_bytes": mine[0]["budget_bytes"], "fitting_static": sorted(r["policy"] for r in static),
               "dpp_fits_budget": "dpp" in ok}
        if "dpp" in ok and static:
            best = min(static, key=lambda r: r["iter_s"])
            got["best_fitting_static"] = best["policy"]
            got["dpp_speedup_over_best_fitting_static"] = best["iter_s"] / ok["dpp"]["iter_s"]
            got["dpp_speedup_per_batch"] = [b / d for b, d in zip(best["iter_s_all"], ok["dpp"]["iter_s_all"])]
            got["speedup_target_1.15_met"] = got["dpp_speedup_over_best_fitting_static"] >= 1.15
        out[f"budget_fraction_{fraction}"] = got
    errors = [r["act_bytes_error"] for r in records if not r["infeasible"]]
    if errors:
        out["act_bytes_error_max"] = max(errors)
        out["act_bytes_error_target_0.10_met"] = max(errors) <= 0.10
    return out


def measured_records(args) -> tuple[dict, Path]:
    """Calibrate (unless a cost model is given), run the PP=2 workers; their records and the
    file they are in."""
    out = Path(args.json).with_suffix(".worker.json")
    if not args.cost_model:
        args.cost_model = str(Path(args.json).with_suffix(".costmodel.json"))
        subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_ext.dpp.tools.calibrate", "--out", args.cost_model,
                        "--q", "64", "128", "256", "512", "1024", "2048", "--prefix", "0", "1024", "2048"],
                       check=True, cwd=REPO)
    command = [sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               __file__, "--worker-out", str(out), "--cost-model", args.cost_model, "--json", args.json,
               "--model", args.model, "--max-seq-len", str(args.max_seq_len), "--docs", str(args.docs),
               "--batches", str(args.batches), "--seed", str(args.seed), "--budget-fractions", *map(str, args.budget_fractions),
               "--act-budget-mb", str(args.act_budget_mb), "--dist", args.dist,
               *(["--plot", args.plot] if args.plot else []), "--policies", *args.policies]
    subprocess.run(command, check=True, cwd=REPO, env={**__import__("os").environ, "OMP_NUM_THREADS": "1",
                                                       "PYTHONPATH": str(REPO)})
    return json.loads(out.read_text()), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True)
    ap.add_argument("--model", default="llama_tiny")
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--dist", default="github",
                    help="lengths: a distribution of megatron_ext.dpp.planning.lengths (github, commoncrawl, ...) or "
                         "'corpus' (whole documents as they are)")
    ap.add_argument("--plot", default=None, help="PNG: Gantt charts of the measured first step")
    ap.add_argument("--docs", type=int, default=8, help="documents per global batch")
    ap.add_argument("--batches", type=int, default=5,
                    help="global batches; every policy runs each once (timed), after one untimed warm-up step")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--budget-fractions", type=float, nargs="+", default=[0.6, 0.35],
                    help="activation budgets, as fractions of what dpp without recompute needs; all of them "
                         "run interleaved on the same batches")
    ap.add_argument("--act-budget-mb", type=float, default=0.0, help="explicit activation budget per stage")
    ap.add_argument("--cost-model", default=None, help="a calibrate.py JSON; default: calibrate now")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--worker-out", default=None)
    args = ap.parse_args()
    if args.worker_out:
        worker(args)
        return
    require(__file__, {"matplotlib": "--plot" if args.plot else None})
    result, worker_out = measured_records(args)
    out = {"measured": result["records"], "targets": summary(result["records"]), "details": result,
           "provenance": provenance(__file__)}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(json.dumps(out["targets"], indent=1))
    if args.plot:
        from megatron_ext.dpp.planning.gantt import save

        panels = panels_file(worker_out)
        save(args.plot, pickle.loads(panels.read_bytes()))
        panels.unlink()


if __name__ == "__main__":
    main()
