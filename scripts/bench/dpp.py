"""DPP benchmark: iteration time, bubbles, recompute and memory of every policy.

`simulated`: LLaMA-7B/13B shapes, contexts 32K/64K/128K, PP 4 and 8, GitHub- and
CommonCrawl-like length distributions, 80 GB per stage, the analytical GPU cost model
(megatron_ext.dpp.planning.costmodel.analytic_gpu), every policy planned on the same global batch and run
by the discrete-event simulator. Static policies are tuned once per configuration on a separate
tuning batch (see planner.tune_static). `measured`: real PP=2 runs on CPU workers, from the
JSON of scripts/bench/dpp_measured.py (see `measured_records`).

    python scripts/bench/dpp.py --json scripts/bench/results/dpp.json --plot scripts/bench/results/dpp.png
    python scripts/bench/dpp.py --json x.json --models llama-7b --contexts 65536 --pps 4 --dists github
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_ext.dpp.planning.costmodel import MODEL_SHAPES, analytic_gpu  # noqa: E402
from megatron_ext.dpp.planning.lengths import get_distribution, sample_batch  # noqa: E402
from megatron_ext.dpp.planning.planner import POLICIES, STATIC_POLICIES, plan_step_info, tune_static  # noqa: E402
from megatron_ext.dpp.planning.recompute import BudgetTooSmall  # noqa: E402
from megatron_ext.dpp.planning.simulate import simulate  # noqa: E402
from extras import require  # noqa: E402  (scripts/bench/extras.py, beside this script)
from provenance import provenance  # noqa: E402  (scripts/bench/provenance.py, beside this script)

BUDGET = 80e9


def simulated_records(args) -> tuple[list[dict], dict]:
    records, gantt = [], {}
    for model in args.models:
        cost = analytic_gpu(MODEL_SHAPES[model])
        for context in args.contexts:
            for pp in args.pps:
                for dist_name in args.dists:
                    dist = get_distribution(dist_name)
                    tuning = sample_batch(dist, args.batch, context, np.random.default_rng(args.seed + 1000)).lengths
                    batch = sample_batch(dist, args.batch, context, np.random.default_rng(args.seed))
                    for policy in args.policies:
                        t = time.perf_counter()
                        static = tune_static(policy, tuning, cost, pp, BUDGET, context) if policy in STATIC_POLICIES else None
                        tune_s = time.perf_counter() - t
                        rec = dict(model=model, context=context, pp=pp, distribution=dist_name, policy=policy,
                                   budget_bytes=BUDGET, batch_sequences=args.batch, truncated=batch.truncated)
                        try:
                            plan, info = plan_step_info(batch.lengths, cost, pp, BUDGET, policy, static=static)
                        except BudgetTooSmall as e:
                            rec.update(iter_s=None, bubble_ratio=None, peak_mem_bytes=None, planner_s=None,
                                       infeasible=True, min_budget_bytes=e.min_budget_bytes, oom=True)
                            records.append(rec)
                            print(f"{model} {context} pp{pp} {dist_name} {policy}: no plan fits ({e})", flush=True)
                            continue
                        sim = simulate(plan, cost, budget_bytes=BUDGET)
                        rec.update(
                            iter_s=sim.iter_s, bubble_ratio=sim.bubble_ratio, peak_mem_bytes=max(sim.peak_bytes),
                            planner_s=info.planner_s, recompute_fraction=sim.recompute_fraction,
                            peak_mem_bytes_per_stage=list(sim.peak_bytes), oom=any(sim.oom), infeasible=False,
                            chunks=len(plan.chunks), groups=len(plan.groups), param=info.k,
                            ckpt_solves=info.ckpt_solves, ckpt_solve_max_s=info.ckpt_solve_max_s,
                            static_tune_s=tune_s if static else None,
                        )
                        records.append(rec)
                        print(f"{model} {context:6d} pp{pp} {dist_name:11s} {policy:14s} iter {sim.iter_s:8.2f}s "
                              f"bubble {sim.bubble_ratio:5.1%} recompute {sim.recompute_fraction:5.1%} "
                              f"peak {max(sim.peak_bytes) / 1e9:5.1f} GB{' OOM' if any(sim.oom) else ''} "
                              f"chunks {len(plan.chunks):4d} groups {len(plan.groups)} param {info.k} "
                              f"plan {info.planner_s:.2f}s", flush=True)
                        key = (model, context, pp, dist_name)
                        if policy in ("dpp", "split") and context == args.gantt_context and len(gantt) <= (key in gantt):
                            gantt.setdefault(key, {})[policy] = (plan, sim)
    return records, gantt


def targets(records: list[dict]) -> dict:
    """DPP >= 1.3x split and >= 1.5x packed at contexts >= 64K; DPP bubble < 20%; no DPP plan
    over budget. Ratios use each configuration's own batch."""
    by = {}
    for r in records:
        by.setdefault((r["model"], r["context"], r["pp"], r["distribution"]), {})[r["policy"]] = r
    rows, ok = [], {"split_1.3x": True, "packed_1.5x": True, "bubble_below_20pct": True, "dpp_within_budget": True}
    for key, pol in sorted(by.items()):
        d = pol.get("dpp")
        if d is None:
            continue
        row = dict(zip(("model", "context", "pp", "distribution"), key))
        if d["infeasible"]:
            ok["dpp_within_budget"] = False
            rows.append(row | {"dpp": "infeasible"})
            continue
        for base in ("packed", "split", "chunkflow"):
            b = pol.get(base)
            if b is not None:
                row[f"vs_{base}"] = None if b["infeasible"] else b["iter_s"] / d["iter_s"]
                row[f"{base}_oom"] = b["oom"]
        row["dpp_bubble"] = d["bubble_ratio"]
        if key[1] >= 65536:
            if row.get("vs_split") is not None and row["vs_split"] < 1.3:
                ok["split_1.3x"] = False
            if row.get("vs_packed") is not None and row["vs_packed"] < 1.5:
                ok["packed_1.5x"] = False
        ok["bubble_below_20pct"] &= d["bubble_ratio"] < 0.20
        ok["dpp_within_budget"] &= not d["oom"]
        rows.append(row)
    return {"met": ok, "rows": rows}


def measured_records(args) -> list[dict]:
    """MEASURED TABLE: real PP=2 runs on 2 CPU workers (a small LLaMA-style model, a context of
    a few thousand tokens, the same global batches and per-stage budget for every policy), made
    by the DPP runtime's `scripts/bench/dpp_measured.py`. Its records (policy, iter_s,
    peak_act_bytes, budget_bytes, predicted_act_bytes) are taken from the JSON it wrote,
    `--measured-json`; without it the list is empty."""
    if not args.measured_json:
        return []
    return json.loads(Path(args.measured_json).read_text())["measured"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--models", nargs="+", default=["llama-7b", "llama-13b"])
    ap.add_argument("--contexts", nargs="+", type=int, default=[32768, 65536, 131072])
    ap.add_argument("--pps", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--dists", nargs="+", default=["github", "commoncrawl"])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--batch", type=int, default=256, help="sequences per global batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gantt-context", type=int, default=65536)
    ap.add_argument("--measured-json", default=None, help="output of scripts/bench/dpp_measured.py to include")
    args = ap.parse_args()
    require(__file__, {"matplotlib": "--plot" if args.plot else None})

    simulated, gantt = simulated_records(args)
    summary = targets(simulated)
    measured = measured_records(args)
    out = {"simulated": simulated, "measured": measured, "targets": summary, "provenance": provenance(__file__)}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(json.dumps(summary["met"]))
    planner = [r["planner_s"] for r in simulated if r["policy"] == "dpp" and r["planner_s"] is not None]
    if planner:
        print(f"dpp planner: median {statistics.median(planner):.2f}s, max {max(planner):.2f}s (CPU)")
    if args.plot and gantt:
        from megatron_ext.dpp.planning.gantt import from_events, save

        (model, context, pp, dist), runs = next(iter(gantt.items()))
        panels = [(from_events(sim.events), plan, f"{policy}: {model}, context {context}, PP {pp}, {dist}, "
                   f"iteration {sim.iter_s:.1f}s, bubbles {sim.bubble_ratio:.0%}") for policy, (plan, sim) in sorted(runs.items())]
        save(args.plot, panels)


if __name__ == "__main__":
    main()
