"""Packed LoRA: training throughput and sweep makespan.

    python scripts/bench/lora.py --json OUT.json [--plot OUT.png] [--skip-sweep]

`throughput`: tokens/s of K = 1, 2, 4, 8, 16 LoRA jobs (rank 8 on every linear, each its own
data) trained
  packed      in one process, one base (runtime.PackedTrainer), passes capped as by default
              (lora.max_pass_tokens=auto, pass_size.py; the record's `pass_cap` "auto" and
              `max_pass_tokens` what it came to); again in one pass per step (`pass_cap`
              null), and under each cap of --pass-micro-batches N: passes of at most N jobs'
              micro-batches (`pass_cap` = N x batch x seq_length);
  sequential  in one process, one job after another on the same base;
  processes   as K concurrent processes, each with its own copy of the base;
at a small and a larger per-job micro-batch. Every measurement is a fresh worker process (one
thread) that warms up, then times its K jobs over at least --steps steps each and --min-tokens
tokens in all; its peak RSS is that run's (summed over the concurrent processes of
`processes`). tokens_per_s uses the wall clock, tokens_per_cpu_s the CPU time (on a shared
machine the wall clock counts other people's work). Every run is measured --repeats times, in
rounds; a round measures the modes of each K back to back, every other round in reverse order;
a record holds the medians and each repeat's tokens/CPU s.
`throughput_targets` compares each packed run (`packed`: the default cap; `packed_one_pass`;
`packed_cap<tokens>`) with sequential, and its K=8 peak with a single job's (sequential K=1).

`pass_rates`: tokens per CPU second of one job's passes of 128 to 8,192 tokens (calibrate.
measure_pass_rates, in a fresh process) and their knee (pass_size.knee): what
pass_size.CPU_PASS_TOKENS, the CPU's `auto` cap, is set from.

`sweep`: scripts/bench/lora_sweep.py (planner vs sequential / per_job / pack_all makespans,
measured here and simulated on 8 x 80 GB GPUs, and the gap to the exact optimum).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Union
from extras import require  # noqa: E402  (scripts/bench/extras.py, beside this script)
from provenance import provenance  # noqa: E402  (scripts/bench/provenance.py, beside this script)

REPO = Path(__file__).resolve().parents[2]
for path in (REPO, REPO / "scripts" / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

KS = (1, 2, 4, 8, 16)
Cap = Union[int, str, None]  # a lora.max_pass_tokens setting
BATCHES = {"small": 1, "larger": 4}
MODEL = dict(num_layers=4, hidden_size=256, ffn_hidden_size=704, num_attention_heads=4, num_query_groups=2,
             seq_length=128, vocab_size=512)
VOCAB = 512


def jobs(k: int, batch: int, steps: int):
    from megatron_ext.lora.job import LoraJob

    return [LoraJob(f"j{i}", rank=8, lr=1e-4, micro_batch_size=batch, global_batch_size=batch, seq_length=MODEL["seq_length"],
                    steps=steps, seed=i, eval_iters=0) for i in range(k)]


# --- one worker process ---------------------------------------------------------------------------


def worker(mode: str, k: int, batch: int, steps: int, warmup: int, setting: Cap, start_file: Optional[str]) -> dict:
    """Train and time K jobs of `mode` in this fresh process (its peak RSS is that run's).
    `setting`: packed's lora.max_pass_tokens. `start_file`: wait for it before the timed steps
    (concurrent processes start their timed windows together)."""
    import torch

    from megatron_ext.config.schema import ModelConfig
    from megatron_ext.lora.planning.pass_size import resolve
    from megatron_ext.lora.runtime.base import build_base
    from megatron_ext.lora.runtime.batching import SyntheticData
    from megatron_ext.lora.runtime.packed import PackedTrainer
    from megatron_ext.models.convert.world import model_parallel_world

    torch.set_num_threads(1)
    cap = resolve(setting, None, cuda=False)
    with model_parallel_world():
        model, wrappers, routing = build_base(ModelConfig(**MODEL), VOCAB)
        data = lambda job: SyntheticData(job, VOCAB)  # noqa: E731

        def run(js, capacity):
            trainer = PackedTrainer(model, wrappers, routing, data, capacity, max_pass_tokens=cap)
            trainer.submit(js)
            trainer.run()

        run(jobs(1, batch, warmup), 1)  # warm-up
        if start_file:
            Path(start_file + f".ready{os.getpid()}").touch()
            while not Path(start_file).exists():
                time.sleep(0.05)
        timed = jobs(k, batch, steps)
        wall, cpu = time.perf_counter(), time.process_time()
        if mode == "packed":
            run(timed, k)
        else:  # sequential (and each process of `processes`, which runs one job)
            for job in timed:
                run([job], 1)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        tokens = sum(j.micro_batch_size * j.seq_length * j.steps for j in timed)
        return {"k": k, "tokens": tokens, "wall_s": wall, "cpu_s": cpu, "end": time.time(), "start": time.time() - wall,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "max_pass_tokens": cap}


def rates_worker() -> dict:
    """calibrate.measure_pass_rates on the benchmark's model, in this fresh process."""
    import torch

    from megatron_ext.config.schema import ModelConfig
    from megatron_ext.lora.calibrate import measure_pass_rates
    from megatron_ext.lora.planning.pass_size import KNEE, knee
    from megatron_ext.lora.runtime.base import build_base
    from megatron_ext.models.convert.world import model_parallel_world

    torch.set_num_threads(1)
    with model_parallel_world():
        base = build_base(ModelConfig(**MODEL), VOCAB)
        rates = measure_pass_rates(*base, VOCAB, MODEL["seq_length"], seconds=1.0)
    return {"tokens_per_cpu_s": {str(size): rate for size, rate in rates.items()}, "knee_fraction": KNEE, "knee": knee(rates)}


def spawn(mode: str, k: int, batch: int, steps: int, warmup: int, out: Path, start_file: Optional[str] = None,
          cap: Cap = None) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    command = [sys.executable, "-W", "ignore", __file__, "--worker", mode, str(k), str(batch), str(steps), str(warmup), str(cap), str(out)]
    if start_file:
        command.append(start_file)
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finished(proc: subprocess.Popen, out: Path) -> dict:
    _, err = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"benchmark worker failed:\n{err[-3000:]}")
    return json.loads(out.read_text())


def record(r: dict) -> dict:
    return {"tokens_per_s": r["tokens"] / r["wall_s"], "tokens_per_cpu_s": r["tokens"] / r["cpu_s"],
            "peak_mem_bytes": r["peak_rss_bytes"], "max_pass_tokens": r["max_pass_tokens"]}


def measure_in_process(mode: str, k: int, batch: int, steps: int, warmup: int, tmp: Path, cap: Cap = None) -> dict:
    out = tmp / f"{mode}-{k}-{batch}-{cap}.json"
    return {"k": k, **record(finished(spawn(mode, k, batch, steps, warmup, out, cap=cap), out))}


def measure_processes(k: int, batch: int, steps: int, warmup: int, tmp: Path) -> dict:
    start = tmp / f"start-{k}-{batch}"
    outs = [tmp / f"proc-{k}-{batch}-{i}.json" for i in range(k)]
    procs = [spawn("sequential", 1, batch, steps, warmup, out, str(start)) for out in outs]
    while len(list(tmp.glob(f"start-{k}-{batch}.ready*"))) < k:
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.1)
    start.touch()
    results = [finished(p, o) for p, o in zip(procs, outs)]
    tokens = sum(r["tokens"] for r in results)
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    return {"k": k, "tokens_per_s": tokens / span, "tokens_per_cpu_s": tokens / sum(r["cpu_s"] for r in results),
            "peak_mem_bytes": sum(r["peak_rss_bytes"] for r in results), "max_pass_tokens": None}


def steps_for(args: argparse.Namespace, k: int, batch: int) -> int:
    """Timed steps per job: at least --steps, and enough for --min-tokens over the K jobs, so
    that small runs are timed over seconds, not a fraction of one."""
    return max(args.steps, math.ceil(args.min_tokens / (k * batch * MODEL["seq_length"])))


def measure_round(args: argparse.Namespace, batch: int, tmp: Path, reverse: bool) -> list[dict]:
    """One measurement of every run at this batch, the modes of each K back to back (a machine
    that drifts moves them together); `reverse` flips the modes' order, so that repeats
    alternate which goes first."""
    runs = [("sequential", None), ("packed", "auto"), ("packed", None)]
    runs += [("packed", n * batch * MODEL["seq_length"]) for n in args.pass_micro_batches]
    runs.append(("processes", None))
    rows = []
    for k in args.ks:
        steps = steps_for(args, k, batch)
        for mode, cap in reversed(runs) if reverse else runs:
            if mode != "processes":
                rows.append(dict(measure_in_process(mode, k, batch, steps, args.warmup, tmp, cap), mode=mode, pass_cap=cap))
            elif k <= args.max_processes:
                rows.append(dict(measure_processes(k, batch, steps, args.warmup, tmp), mode=mode, pass_cap=None))
    return rows


def median_record(rows: list[dict], batch: int, size: str) -> dict:
    """The medians of one run's repeats, with every repeat's tokens/s kept (the spread)."""
    first = rows[0]
    out = {"k": first["k"], "batch": batch, "batch_size": size, "mode": first["mode"], "pass_cap": first["pass_cap"],
           "max_pass_tokens": first["max_pass_tokens"]}
    for key in ("tokens_per_s", "tokens_per_cpu_s", "peak_mem_bytes"):
        out[key] = statistics.median(r[key] for r in rows)
    out["tokens_per_cpu_s_repeats"] = [r["tokens_per_cpu_s"] for r in rows]
    return out


def throughput(args: argparse.Namespace) -> list[dict]:
    records = []
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        for size in args.batches:
            batch = BATCHES[size]
            repeats: dict[tuple, list[dict]] = {}
            for i in range(args.repeats):
                for r in measure_round(args, batch, Path(tmp), reverse=i % 2 == 1):
                    repeats.setdefault((run_of(r), r["k"]), []).append(r)
            for rows in repeats.values():
                r = median_record(rows, batch, size)
                records.append(r)
                spread = ", ".join(f"{x:.0f}" for x in r["tokens_per_cpu_s_repeats"])
                print(f"K={r['k']:2d} batch={batch} {run_of(r):18s} {r['tokens_per_s']:8.0f} tok/s "
                      f"({r['tokens_per_cpu_s']:8.0f} per CPU s; repeats {spread})  peak {r['peak_mem_bytes'] / 2**20:7.0f} MiB", flush=True)
    return records


def pass_rates(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        out = Path(tmp) / "rates.json"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        proc = subprocess.Popen([sys.executable, "-W", "ignore", __file__, "--rates-worker", str(out)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        rates = finished(proc, out)
    print("pass rates (tokens per CPU s):", {k: round(v) for k, v in rates["tokens_per_cpu_s"].items()}, "knee", rates["knee"], flush=True)
    return rates


def run_of(r: dict) -> str:
    """A record's run: its mode, and for packed runs the pass cap asked for."""
    if r["mode"] != "packed" or r["pass_cap"] == "auto":
        return r["mode"]
    return "packed_one_pass" if r["pass_cap"] is None else f"packed_cap{r['pass_cap']}"


def targets(records: list[dict]) -> dict:
    """The CPU targets: packed at least as fast as sequential (per CPU second and per wall
    second), and packed K=8 peak memory at most 1.5x a single job's (sequential K=1); for every
    packed run (keys named after run_of)."""
    get = {(r["k"], r["batch"], run_of(r)): r for r in records}
    out = {}
    for (k, batch, run), r in get.items():
        if r["mode"] != "packed":
            continue
        if (k, batch, "sequential") in get:
            seq = get[(k, batch, "sequential")]
            out[f"{run}_vs_sequential_k{k}_b{batch}"] = {
                "wall": r["tokens_per_s"] / seq["tokens_per_s"], "cpu": r["tokens_per_cpu_s"] / seq["tokens_per_cpu_s"]}
        if k == 8 and (1, batch, "sequential") in get:
            out[f"{run}_peak_mem_k8_over_single_b{batch}"] = r["peak_mem_bytes"] / get[(1, batch, "sequential")]["peak_mem_bytes"]
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = result["throughput"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, label in ((axes[0], "tokens_per_cpu_s", "tokens / CPU s"), (axes[1], "peak_mem_bytes", "peak memory (MiB)")):
        for batch in sorted({r["batch"] for r in records}):
            for run in sorted({run_of(r) for r in records if r["batch"] == batch}):
                rs = sorted((r for r in records if r["batch"] == batch and run_of(r) == run), key=lambda r: r["k"])
                ys = [r[key] / (2**20 if key == "peak_mem_bytes" else 1) for r in rs]
                style = {"packed": "-o", "sequential": "--s", "processes": ":^", "packed_one_pass": "-.x"}.get(run, "-.d")
                ax.plot([r["k"] for r in rs], ys, style, label=f"{run}, batch {batch}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("jobs K")
        ax.set_ylabel(label)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    if "sweep" in result:
        import lora_sweep

        lora_sweep.plot(result["sweep"], str(Path(path).with_name(Path(path).stem + "_sweep.png")))


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        mode, k, batch, steps, warmup, cap, out = argv[1:8]
        setting = None if cap == "None" else cap if cap == "auto" else int(cap)
        result = worker(mode, int(k), int(batch), int(steps), int(warmup), setting, argv[8] if len(argv) > 8 else None)
        Path(out).write_text(json.dumps(result))
        return
    if argv[:1] == ["--rates-worker"]:
        Path(argv[1]).write_text(json.dumps(rates_worker()))
        return
    import lora_sweep

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--plot")
    p.add_argument("--ks", type=int, nargs="+", default=list(KS))
    p.add_argument("--batches", nargs="+", default=list(BATCHES), choices=list(BATCHES))
    p.add_argument("--steps", type=int, default=4, help="timed optimizer steps per job, at least")
    p.add_argument("--min-tokens", type=int, default=8192, help="timed tokens of a run, at least (more steps for small K)")
    p.add_argument("--repeats", type=int, default=3, help="measurements of every run, interleaved; records are their medians")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--max-processes", type=int, default=16, help="largest K run as concurrent processes")
    p.add_argument("--pass-micro-batches", type=int, nargs="*", default=[],
                   help="packed again with passes of at most N jobs' micro-batches, for each N")
    p.add_argument("--skip-pass-rates", action="store_true")
    p.add_argument("--tmp", default=None, help="folder for the workers' files")
    p.add_argument("--skip-sweep", action="store_true")
    lora_sweep.add_arguments(p)
    args = p.parse_args(argv)
    require(__file__, {"matplotlib": "--plot" if args.plot else None, **({} if args.skip_sweep else lora_sweep.needs(args))})
    result = {"throughput": throughput(args)}
    result["throughput_targets"] = targets(result["throughput"])
    if not args.skip_pass_rates:
        result["pass_rates"] = pass_rates(args)
    planned = None
    if not args.skip_sweep:
        result["sweep"], planned = lora_sweep.sweep(args)
    result["provenance"] = provenance(__file__, argv)
    Path(args.json).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)
        if planned is not None:
            lora_sweep.draw_gantt(planned, Path(args.json).resolve().parent)


if __name__ == "__main__":
    main()
