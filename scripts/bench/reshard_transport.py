"""The reshard executor's two transports side by side: one plan, moved through shared memory and
as gloo messages, alternately, on the same workers.

    python scripts/bench/reshard_transport.py --json transport.json
    python scripts/bench/reshard_transport.py --model llama_tiny --transition 'dp4->tp4' --repeats 5

`--nproc` local CPU workers plan A -> B for the model's training state (params, fp32 main
params, Adam moments, step) and move it with `execute`: every rank's source pieces are plain
tensors of their real shapes and dtypes, the destination pieces are allocated (and faulted in)
before timing, and each transport moves the same plan `--repeats` times, the two alternating so
that changes of load hit both alike. A time is the max over ranks; the JSON gives every repeat
and the medians. This times the transfer alone: the stall of a live reshard adds the switch
(see reshard.py, whose `stall_messages_s` is the same comparison inside the whole move).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from provenance import provenance  # noqa: E402  (scripts/bench/provenance.py, beside this script)

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TRANSPORTS = {"messages": False, "shared memory": True}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True)
    p.add_argument("--model", default="llama_100m")
    p.add_argument("--transition", default="tp2,pp2->dp4", help="A->B, sizes as tp2,pp2,dp,ep")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget-mb", type=float, default=64.0)
    p.add_argument("--vocab-size", type=int, default=49152)
    return p.parse_args(argv)


def layout_of(text: str, world: int):
    """'tp2,pp2' -> ParallelLayout(tp=2, pp=2, dp=world / 4)."""
    from megatron_ext.parallel.layout import ParallelLayout

    sizes = {part[:2]: int(part[2:]) for part in text.split(",") if part}
    model_parallel = sizes.get("tp", 1) * sizes.get("pp", 1)
    sizes.setdefault("dp", world // model_parallel)
    return ParallelLayout(**sizes)


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_ext.config.store import MODEL_PRESETS
    from megatron_ext.reshard.boxes import box_shape
    from megatron_ext.reshard.execute import execute, rounds
    from megatron_ext.reshard.plan import plan

    dist.init_process_group("gloo", rank=rank, world_size=args.nproc)
    parallel_state.initialize_model_parallel()  # the planner runs inside a job's parallel state
    model = dataclasses.replace(MODEL_PRESETS[args.model], vocab_size=args.vocab_size)
    a, b = (layout_of(side, args.nproc) for side in args.transition.split("->"))
    p = plan(model, a, b)
    steps = rounds(p, int(args.budget_mb * 2**20))
    have = {s: torch.ones(box_shape(s.box), dtype=getattr(torch, s.dtype)) for s in p.sources if s.rank == rank}
    want = {t: torch.zeros(box_shape(t.box), dtype=getattr(torch, t.dtype)) for t in p.targets if t.rank == rank}

    def read(piece, box):
        return have[piece][_relative(piece.box, box)]

    def write(piece, box, values):
        want[piece][_relative(piece.box, box)].copy_(values)

    seconds: dict[str, list[float]] = {name: [] for name in TRANSPORTS}
    for _ in range(args.repeats):
        for name, shared_memory in TRANSPORTS.items():
            dist.barrier()
            start = time.perf_counter()
            done = execute(p, steps, read, write, shared_memory=shared_memory)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            assert done.transport == name, f"asked for {name}, moved through {done.transport}"
            seconds[name].append(elapsed.item())
    arrived = all(bool(t.eq(1).all()) for t in want.values())
    everywhere = torch.tensor([int(arrived)])
    dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)
    if rank == 0:
        write_report(args, p, steps, seconds, bool(everywhere.item()))
    dist.destroy_process_group()


def _relative(outer, box):
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, outer))


def write_report(args, p, steps, seconds: dict[str, list[float]], arrived: bool) -> None:
    import torch

    medians = {name: statistics.median(s) for name, s in seconds.items()}
    report = {
        "benchmark": "reshard executor: shared memory vs gloo messages",
        "model": args.model,
        "transition": f"{p.a} -> {p.b}",
        "world": args.nproc,
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__},
        "bytes_moved": p.network_bytes,
        "rounds": len(steps),
        "seconds": seconds,
        "median_s": medians,
        "ratio_messages_over_shared_memory": medians["messages"] / medians["shared memory"],
        "state_arrived": arrived,
        "provenance": provenance(__file__, args.argv),
    }
    Path(args.json).write_text(json.dumps(report, indent=1))
    for name, median in medians.items():
        print(f"{name:>14}: {median:.3f} s (median of {args.repeats}; {p.network_bytes / 2**20:.0f} MiB)")
    print(f"messages / shared memory: {report['ratio_messages_over_shared_memory']:.2f}x; wrote {args.json}")


def main(argv=None) -> None:
    import torch.multiprocessing as mp

    from megatron_ext.platform.launch import free_port

    args = parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv  # for the provenance record rank 0 writes
    mp.spawn(worker, args=(args, free_port()), nprocs=args.nproc)


if __name__ == "__main__":
    main()
