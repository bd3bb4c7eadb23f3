"""Live reshard vs checkpoint-based reshard: same state, same A -> B, one launch.

    python scripts/bench/reshard_vs_checkpoint.py --model llama_tiny --repeats 3 --out results.json
    torchrun --nproc-per-node 4 scripts/bench/reshard_vs_checkpoint.py --model llama_small

Each trial, on every rank:
  1. a fresh Trainer in layout A (default tp2 pp2) runs `--steps` training steps (real Adam state);
  2. baseline, part 1: `trainer.save()` in layout A into `--ckpt-dir` (timed: "save"); then
     `os.sync()` (timed separately, "sync", not in the total);
  3. ours: `reshard(trainer, B, budget)` from that same state (plan_seconds, stall_seconds from
     the report; the stall is split into "build" = `Trainer.switch_layout` and "transfer" = the
     rest, by wrapping the trainer's `switch_layout` method); one step in B -> loss_live;
  4. baseline, part 2: the counters are put back to the saved ones, `trainer.switch_layout(B)`
     builds a fresh B world (timed: "build") and `ckpt.load_checkpoint` loads the checkpoint
     into it (timed: "load"; plus the scheduler from the checkpoint's common state); one step in
     B -> loss_ckpt. The correctness gate: |loss_live - loss_ckpt| <= --loss-atol.
Every phase is bracketed by barriers; a phase's time is the max over ranks; the report gives
the median over `--repeats` trials, after `--warmup` trials that are left out (the first save and
the first plan of a process pay one-time costs; their times are kept in the JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PHASES_CKPT = ("save", "build", "load")
PHASES_LIVE = ("plan", "build", "transfer")


def parse_layout(text: str) -> dict:
    """'tp=2,pp=2' or 'tp2pp2' -> {'tp': 2, 'pp': 2}."""
    import re

    out = {}
    for key, value in re.findall(r"(tp|pp|dp|ep|cp|vpp)\s*=?\s*(\d+)", text):
        out[key] = int(value)
    if not out:
        raise argparse.ArgumentTypeError(f"cannot read layout {text!r}; use e.g. tp=2,pp=2")
    return out


def build_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama_small")
    p.add_argument("--layout-a", type=parse_layout, default={"tp": 2, "pp": 2})
    p.add_argument("--layout-b", type=parse_layout, default={"tp": 1, "pp": 2, "dp": 2})
    p.add_argument("--nproc", type=int, default=4, help="local workers (ignored under torchrun)")
    p.add_argument("--steps", type=int, default=2, help="training steps before the reshard")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="trials run first and left out of the medians")
    p.add_argument("--budget-mb", type=float, default=64.0, help="reshard staging budget per round")
    p.add_argument("--ckpt-dir", default=None, help="where checkpoints go (default: a temp dir under /tmp)")
    p.add_argument("--loss-atol", type=float, default=2e-4)
    p.add_argument("--out", default="results.json")
    p.add_argument("--plot", default=None, help="SVG bar chart (default: <out>.svg)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="extra config overrides (e.g. model.seq_length=128)")
    return p.parse_args(argv)


def overrides(args) -> list[str]:
    a = args.layout_a
    return [
        f"model={args.model}",
        "experiment=none",
        f"launcher.nproc={args.nproc}",
        f"train.iters={max(10, args.steps + 5)}",
        "train.eval_interval=0",
        "train.micro_batch_size=2",
        "train.global_batch_size=8",
        "logging.progress_bar=false",
        *[f"parallel.{k}={v}" for k, v in a.items()],
        *args.set,
    ]


# --- one rank ------------------------------------------------------------------------------------


def _max_over_ranks(values: dict) -> dict:
    import torch
    import torch.distributed as dist

    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(keys, t.tolist()))


def _timed(fn):
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    out = fn()
    dist.barrier()
    return out, time.perf_counter() - start


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def trial(cfg, target, args, ckpt_root: Path) -> dict:
    import torch.distributed as dist

    from megatron_ext.reshard.live import reshard
    from megatron_ext.training import checkpoint as ckpt
    from megatron_ext.training.trainer import Trainer, TrainState

    rank = dist.get_rank()
    trainer = Trainer(cfg, [])
    try:
        trainer.setup()
        for _ in range(args.steps):
            trainer.train_step()
        saved_state = dataclasses.replace(trainer.state)

        # Baseline, part 1: save in A.
        _, t_save = _timed(trainer.save)
        _, t_sync = _timed(os.sync)
        iteration = trainer.state.iteration
        written = _dir_bytes(ckpt.iteration_dir(ckpt_root, iteration)) if rank == 0 else 0

        # Ours: live reshard from the same state, with switch_layout timed inside the stall.
        build_live = [0.0]
        switch = trainer.switch_layout

        def timed_switch(parallel):
            start = time.perf_counter()
            switch(parallel)
            build_live[0] = time.perf_counter() - start

        trainer.switch_layout = timed_switch
        dist.barrier()
        report = reshard(trainer, target, args.budget_mb)
        del trainer.switch_layout
        loss_live = trainer.train_step()["loss"]

        # Baseline, part 2: a fresh B world, then load the checkpoint saved in A.
        trainer.state = dataclasses.replace(saved_state)  # the data position switch_layout rebuilds from
        _, t_build = _timed(lambda: trainer.switch_layout(target))
        common, t_load = _timed(
            lambda: ckpt.load_checkpoint(ckpt_root, iteration, trainer.model, trainer.optimizer, load_rng=False)
        )
        trainer.scheduler.load_state_dict(common["scheduler"])
        trainer.state = TrainState(common["iteration"], common["consumed_samples"])
        loss_ckpt = trainer.train_step()["loss"]
    finally:
        trainer.close()

    times = _max_over_ranks(
        {
            "ckpt_save": t_save,
            "ckpt_sync": t_sync,
            "ckpt_build": t_build,
            "ckpt_load": t_load,
            "live_plan": report.prepare_seconds,
            "live_stall": report.stall_seconds,
            "live_build": build_live[0],
        }
    )
    # The transfer part of the stall, per rank then max (not max(stall) - max(build)).
    times["live_transfer"] = _max_over_ranks(
        {"t": report.stall_seconds - build_live[0]}
    )["t"]
    import torch

    w = torch.tensor([written], dtype=torch.int64)
    dist.broadcast(w, src=0)
    return {
        "times": times,
        "network_bytes": report.network_bytes,
        "rounds": report.rounds,
        "peak_staging_bytes": report.peak_bound_bytes,
        "checkpoint_bytes": int(w.item()),
        "loss_live": loss_live,
        "loss_ckpt": loss_ckpt,
        "source": report.source,
        "target": report.target,
    }


def bench_worker(args) -> dict:
    import torch.distributed as dist

    from megatron_ext.config import compose_config
    from megatron_ext.platform.launch import join_world
    from megatron_ext.reshard.plugin import target_config

    cfg = compose_config(overrides(args))
    join_world(cfg.launcher.device)
    rank = dist.get_rank()
    target = target_config(cfg.parallel, args.layout_b)
    if args.ckpt_dir:
        base = Path(args.ckpt_dir)
    else:
        holder = [tempfile.mkdtemp(prefix="bench_ckpt_") if rank == 0 else None]
        dist.broadcast_object_list(holder, src=0)
        base = Path(holder[0])
    trials = []
    try:
        for i in range(args.warmup + args.repeats):
            root = base / f"trial{i}"
            cfg_i = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, save=str(root)))
            result = trial(cfg_i, target, args, root)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(root, ignore_errors=True)
                t = result["times"]
                print(
                    f"[{'warm-up' if i < args.warmup else 'trial'} {i}] ckpt save {t['ckpt_save']:.3f} build {t['ckpt_build']:.3f} load "
                    f"{t['ckpt_load']:.3f} | live plan {t['live_plan']:.3f} stall {t['live_stall']:.3f} "
                    f"(build {t['live_build']:.3f}) | loss live {result['loss_live']:.6f} "
                    f"ckpt {result['loss_ckpt']:.6f}",
                    flush=True,
                )
            trials.append(result)
        summary = summarize(args, cfg, target, dist.get_world_size(), trials[args.warmup:])
        summary["warmup_trials"] = [t["times"] for t in trials[: args.warmup]]
        if rank == 0:
            write_outputs(args, summary)
        return summary
    finally:
        if rank == 0 and not args.ckpt_dir:
            shutil.rmtree(base, ignore_errors=True)
        dist.destroy_process_group()


# --- report --------------------------------------------------------------------------------------


def summarize(args, cfg, target, world: int, trials: list) -> dict:
    med = {k: statistics.median(t["times"][k] for t in trials) for k in trials[0]["times"]}
    # Median of per-trial totals (a total is not the sum of medians in general).
    ckpt_totals = [t["times"]["ckpt_save"] + t["times"]["ckpt_build"] + t["times"]["ckpt_load"] for t in trials]
    ckpt_total = statistics.median(ckpt_totals)
    live_stall = med["live_stall"]
    diffs = [abs(t["loss_live"] - t["loss_ckpt"]) for t in trials]
    return {
        "model": args.model,
        "layout_a": trials[0]["source"],
        "layout_b": trials[0]["target"],
        "layout_a_sizes": args.layout_a,
        "layout_b_sizes": {k: getattr(target, k) for k in ("tp", "pp", "dp", "ep", "cp", "vpp")},
        "world": world,
        "steps_before": args.steps,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "budget_mb": args.budget_mb,
        "overrides": overrides(args),
        "median_seconds": {
            "checkpoint": {"save": med["ckpt_save"], "build": med["ckpt_build"], "load": med["ckpt_load"],
                           "total": ckpt_total, "sync_after_save_not_in_total": med["ckpt_sync"]},
            "live": {"plan": med["live_plan"], "build": med["live_build"], "transfer": med["live_transfer"],
                     "stall": live_stall, "plan_plus_stall": statistics.median(
                         t["times"]["live_plan"] + t["times"]["live_stall"] for t in trials)},
        },
        "ratio_checkpoint_total_over_reshard_stall": ckpt_total / live_stall if live_stall else None,
        "bytes": {
            "reshard_network": trials[0]["network_bytes"],
            "reshard_rounds": trials[0]["rounds"],
            "reshard_peak_staging": trials[0]["peak_staging_bytes"],
            "checkpoint_written": trials[0]["checkpoint_bytes"],
        },
        "loss_check": {
            "atol": args.loss_atol,
            "max_abs_diff": max(diffs),
            "passed": max(diffs) <= args.loss_atol,
            "loss_live": [t["loss_live"] for t in trials],
            "loss_ckpt": [t["loss_ckpt"] for t in trials],
        },
        "trials": [t["times"] for t in trials],
    }


def write_outputs(args, s: dict) -> None:
    out = Path(args.out)
    out.write_text(json.dumps(s, indent=2) + "\n")
    svg = Path(args.plot) if args.plot else out.with_suffix(".svg")
    svg.write_text(bar_chart_svg(s))
    c, l = s["median_seconds"]["checkpoint"], s["median_seconds"]["live"]
    b = s["bytes"]
    print()
    print(f"{s['model']}: {s['layout_a']} -> {s['layout_b']}, world {s['world']}, "
          f"median of {s['repeats']} (max over ranks), seconds")
    print(f"  {'route':<11}{'phase 1':>18}{'phase 2':>18}{'phase 3':>20}{'total':>10}")
    print(f"  {'checkpoint':<11}{'save ' + format(c['save'], '.3f'):>18}{'build ' + format(c['build'], '.3f'):>18}"
          f"{'load ' + format(c['load'], '.3f'):>20}{c['total']:>10.3f}")
    print(f"  {'live':<11}{'plan ' + format(l['plan'], '.3f'):>18}{'build ' + format(l['build'], '.3f'):>18}"
          f"{'transfer ' + format(l['transfer'], '.3f'):>20}{l['stall']:>10.3f}  (stall; +plan {l['plan_plus_stall']:.3f})")
    print(f"  ratio checkpoint total / live stall: {s['ratio_checkpoint_total_over_reshard_stall']:.2f}x")
    print(f"  bytes: reshard network {b['reshard_network'] / 2**20:.2f} MiB in {b['reshard_rounds']} rounds; "
          f"checkpoint written {b['checkpoint_written'] / 2**20:.2f} MiB")
    lc = s["loss_check"]
    print(f"  next-step loss |live - ckpt| max {lc['max_abs_diff']:.2e} (atol {lc['atol']}): "
          f"{'PASS' if lc['passed'] else 'FAIL'}")
    print(f"  wrote {out} and {svg}")


def bar_chart_svg(s: dict) -> str:
    """Two stacked bars (checkpoint route, live route), one colour per phase; written by hand."""
    c, l = s["median_seconds"]["checkpoint"], s["median_seconds"]["live"]
    bars = [
        ("checkpoint", [("save", c["save"], "#d62728"), ("build", c["build"], "#7f7f7f"), ("load", c["load"], "#ff7f0e")]),
        ("live reshard", [("plan", l["plan"], "#9467bd"), ("build", l["build"], "#7f7f7f"),
                          ("transfer", l["transfer"], "#1f77b4")]),
    ]
    width, height, left, top, bottom = 520, 340, 70, 50, 50
    plot_h = height - top - bottom
    vmax = max(sum(v for _, v, _ in parts) for _, parts in bars) or 1.0
    scale = plot_h / (vmax * 1.1)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="14">{s["model"]}: {s["layout_a"]} &#8594; '
           f'{s["layout_b"]} (world {s["world"]}, median of {s["repeats"]})</text>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="black"/>',
           f'<line x1="{left}" y1="{top + plot_h}" x2="{width - 20}" y2="{top + plot_h}" stroke="black"/>',
           f'<text x="15" y="{top + plot_h / 2}" transform="rotate(-90 15 {top + plot_h / 2})" text-anchor="middle">seconds</text>']
    for i in range(5):
        v = vmax * 1.1 * i / 4
        y = top + plot_h - v * scale
        out.append(f'<text x="{left - 5}" y="{y + 4:.1f}" text-anchor="end">{v:.2f}</text>')
        out.append(f'<line x1="{left - 3}" y1="{y:.1f}" x2="{left}" y2="{y:.1f}" stroke="black"/>')
    bar_w = 90
    for j, (name, parts) in enumerate(bars):
        x = left + 60 + j * 170
        y = top + plot_h
        for label, v, colour in parts:
            h = v * scale
            y -= h
            out.append(f'<rect x="{x}" y="{y:.1f}" width="{bar_w}" height="{h:.1f}" fill="{colour}" stroke="white">'
                       f'<title>{label} {v:.3f} s</title></rect>')
            if h > 14:
                out.append(f'<text x="{x + bar_w / 2}" y="{y + h / 2 + 4:.1f}" text-anchor="middle" fill="white">'
                           f'{label} {v:.2f}</text>')
        total = sum(v for _, v, _ in parts)
        out.append(f'<text x="{x + bar_w / 2}" y="{y - 5:.1f}" text-anchor="middle">{total:.3f} s</text>')
        out.append(f'<text x="{x + bar_w / 2}" y="{top + plot_h + 18}" text-anchor="middle">{name}</text>')
    ratio = s["ratio_checkpoint_total_over_reshard_stall"]
    out.append(f'<text x="{width / 2}" y="{height - 10}" text-anchor="middle">checkpoint total / live stall = '
               f'{ratio:.2f}x; loss check {"PASS" if s["loss_check"]["passed"] else "FAIL"}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    args = build_args(argv)
    from megatron_ext.platform.launch import detect_launch, launch_local

    if detect_launch() is None:
        results = launch_local(args.nproc, bench_worker, (args,), "127.0.0.1", 0)
        summary = results[0]
    else:
        summary = bench_worker(args)
    return 0 if summary is None or summary["loss_check"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
