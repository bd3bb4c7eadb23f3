"""A rank's own reshard plan at cluster scale, and how evenly the sending spreads.

    python scripts/bench/rank_plan.py --scale --json rank_plan.json
    python scripts/bench/rank_plan.py --balance --old-root /path/to/a/checkout/of/main

--scale    the issue's three targets and the 70B move at 512 ranks (`SCALE`): per sampled
           rank, from empty caches except its own stage of the running layout, the wall-clock
           and CPU time of rank_plan on one core (the slowest rank is the figure; on a shared
           machine the CPU time is the one the load does not inflate), the RSS before planning
           and its peak while planning; with --bytes, for the moves on at most 1,024 ranks,
           also the network bytes summed over every destination rank against their minimum
           and the bytes each source rank sends, max over mean (no world plan: the 405B
           move's would plan all 16,384 ranks).
--balance  the 100M benchmark's transitions (scripts/bench/reshard.py TRANSITIONS) at 64 MiB:
           max / mean bytes sent per sending rank and the round count, with this checkout's
           planner, and with --old-root, the same for the planner of another checkout, run in a
           subprocess.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# --old-root runs this file's balance_here() against another checkout's planner.
ROOT = os.environ.get("RANK_PLAN_ROOT", str(REPO))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from megatron_ext.config.schema import ModelConfig  # noqa: E402
from megatron_ext.config.store import MODEL_PRESETS  # noqa: E402
from megatron_ext.parallel.layout import ParallelLayout as L  # noqa: E402
from provenance import provenance  # noqa: E402  (scripts/bench/provenance.py, beside this script)

LLAMA_70B = ModelConfig(
    name="llama3_70b", num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
    num_query_groups=8, vocab_size=128256, tie_embeddings=False, precision="bf16",
)
LLAMA_405B = ModelConfig(
    name="llama3_405b", num_layers=126, hidden_size=16384, ffn_hidden_size=53248, num_attention_heads=128,
    num_query_groups=8, vocab_size=129024, tie_embeddings=False, precision="bf16",
)
QWEN3_235B = ModelConfig(
    name="qwen3_235b_a22b", num_layers=94, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=64,
    num_query_groups=4, head_dim=128, vocab_size=151936, tie_embeddings=False, precision="bf16",
    num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=1536,
)

# name -> (model, A, B, target seconds)
SCALE = {
    "70B tp8·pp8·dp16 -> tp8·pp4·dp32 (1,024 ranks)": (LLAMA_70B, L(tp=8, pp=8, dp=16), L(tp=8, pp=4, dp=32), 1.0),
    "405B tp8·pp16·dp128 -> tp8·pp8·dp256 (16,384 ranks)": (
        LLAMA_405B,
        L(tp=8, pp=16, dp=128, first_stage_layers=7, last_stage_layers=7),
        L(tp=8, pp=8, dp=256, first_stage_layers=15, last_stage_layers=15),
        5.0,
    ),
    "235B MoE tp4·pp8·dp32 ep8 -> ep16 (1,024 ranks)": (
        QWEN3_235B,
        L(tp=4, pp=8, dp=32, ep=8, first_stage_layers=11, last_stage_layers=11),
        L(tp=4, pp=8, dp=32, ep=16, first_stage_layers=11, last_stage_layers=11),
        5.0,
    ),
    "70B tp8·pp8·dp8 -> tp8·pp4·dp16 (512 ranks; 107 s as a world plan)": (
        LLAMA_70B, L(tp=8, pp=8, dp=8), L(tp=8, pp=4, dp=16), 1.0,
    ),
}
RSS_TARGET_MB = 300

# scripts/bench/reshard.py's TRANSITIONS, as (model, A, B) of its 100M presets (byte tokenizer:
# 384 padded rows).
DENSE_100M = dataclasses.replace(MODEL_PRESETS["llama_100m"], vocab_size=384)
MOE_100M = dataclasses.replace(MODEL_PRESETS["llama_moe_100m"], vocab_size=384)
BENCH_MOVES = {
    "tp2,pp2->dp4": (DENSE_100M, L(tp=2, pp=2), L(dp=4)),
    "dp4->tp2,pp2": (DENSE_100M, L(dp=4), L(tp=2, pp=2)),
    "dp4->tp4": (DENSE_100M, L(dp=4), L(tp=4)),
    "tp4->dp4": (DENSE_100M, L(tp=4), L(dp=4)),
    "tp2,dp2->pp2,dp2": (DENSE_100M, L(tp=2, dp=2), L(pp=2, dp=2)),
    "pp2,dp2->tp2,pp2": (DENSE_100M, L(pp=2, dp=2), L(tp=2, pp=2)),
    "ep2->ep4": (MOE_100M, L(dp=4, ep=2), L(dp=4, ep=4)),
    "ep4->ep2": (MOE_100M, L(dp=4, ep=4), L(dp=4, ep=2)),
}
BUDGET = 64 << 20


BYTES_MAX_WORLD = 1024


def scale(with_bytes: bool) -> dict:
    from megatron_ext.reshard.plan_scale import moved_bytes, send_balance

    out = {}
    for name, (model, a, b, target) in SCALE.items():
        # A fresh process per case: memory an earlier case freed but kept would hide its peak.
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            row = pool.apply(_measure_rank_plan, (model, a, b))
        row["target_seconds"], row["target_rss_mb"] = target, RSS_TARGET_MB
        print(f"{name}: slowest rank {row['slowest_rank_cpu']} {row['cpu_seconds']:.2f} s CPU, "
              f"slowest by the clock {row['slowest_rank']} {row['seconds']:.2f} s (target {target} s); "
              f"peak RSS {row['peak_rss_mb']:.0f} MB, the planner's part {row['planner_added_mb']:.0f} MB "
              f"(after import {row['import_rss_mb']:.0f} MB)", flush=True)
        if with_bytes and max(a.world, b.world) <= BYTES_MAX_WORLD:
            start = time.process_time()
            row.update(moved_bytes(model, a, b), moved_bytes_cpu_seconds=time.process_time() - start)
            start = time.process_time()
            row.update(send_balance=send_balance(model, a, b), send_balance_cpu_seconds=time.process_time() - start)
            print(f"{name}: network bytes {row['network_bytes']} (minimum {row['min_bytes']}), sent max / mean "
                  f"{row['send_balance']['max_over_mean']:.3f}", flush=True)
        out[name] = row
    return out


def _measure_rank_plan(model: ModelConfig, a: L, b: L) -> dict:
    from megatron_ext.reshard.plan_scale import measure_rank_plan

    return measure_rank_plan(model, a, b)


def machine() -> str:
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{os.cpu_count()} cores, load average (1, 5, 15 min) {load}"


def balance_here() -> dict:
    """This checkout's planner on the benchmark moves."""
    from megatron_ext.reshard.execute import rounds
    from megatron_ext.reshard.plan import plan

    out = {}
    for name, (model, a, b) in BENCH_MOVES.items():
        p = plan(model, a, b)
        sent = [p.sent(r) for r in range(p.world)]
        senders = [s for s in sent if s]
        out[name] = {
            "max_sent_mb": max(sent) / 2**20,
            "mean_sent_mb": sum(senders) / len(senders) / 2**20,
            "max_over_mean": max(sent) / (sum(senders) / len(senders)),
            "network_mb": p.network_bytes / 2**20,
            "min_mb": p.min_bytes / 2**20,
            "rounds_64mib": len(rounds(p, BUDGET)),
        }
    return out


def balance(old_root: str | None) -> dict:
    out = {"this checkout": balance_here()}
    if old_root:
        env = {**os.environ, "PYTHONPATH": old_root, "RANK_PLAN_ROOT": old_root, "OMP_NUM_THREADS": "1"}
        here = str(REPO / "scripts/bench")
        script = (
            f"import sys; sys.path.insert(0, {here!r}); import rank_plan, json; "
            "print(json.dumps(rank_plan.balance_here()))"
        )
        done = subprocess.run([sys.executable, "-c", script], cwd=old_root, env=env, capture_output=True, text=True)
        if done.returncode:
            sys.exit(done.stderr[-2000:])
        out[f"planner of {old_root}"] = json.loads(done.stdout.strip().splitlines()[-1])
    for who, rows in out.items():
        print(who)
        for name, r in rows.items():
            print(f"  {name:>18}: sent max {r['max_sent_mb']:.1f} MiB / mean {r['mean_sent_mb']:.1f} MiB "
                  f"= {r['max_over_mean']:.2f}, network {r['network_mb']:.1f} MiB (min {r['min_mb']:.1f}), "
                  f"{r['rounds_64mib']} rounds at 64 MiB")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", action="store_true", help="time the three cluster-scale targets")
    parser.add_argument("--bytes", action="store_true", help="with --scale: network bytes against the minimum")
    parser.add_argument("--balance", action="store_true", help="send balance and rounds of the 100M moves")
    parser.add_argument("--old-root", help="with --balance: a checkout whose planner to compare")
    parser.add_argument("--json", help="write the results here, keeping the sections of a file already there that "
                        "this run does not measure")
    args = parser.parse_args()
    if not (args.scale or args.balance):
        parser.error("give --scale and/or --balance")
    result = json.loads(Path(args.json).read_text()) if args.json and Path(args.json).exists() else {}
    if args.balance:
        result["balance"] = balance(args.old_root)
        result["balance_machine"] = machine()
    if args.scale:
        result["scale_machine_at_start"] = machine()
        result["scale"] = scale(args.bytes)
        result["scale_machine_at_end"] = machine()
    result["provenance"] = provenance(__file__)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
