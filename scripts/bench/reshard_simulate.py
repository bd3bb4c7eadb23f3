"""Calibrate the stall simulator (megatron_ext/reshard/simulate.py) on this machine and check it
against the reshard benchmark's measured stalls.

    python scripts/bench/reshard_simulate.py --json scripts/bench/results/reshard_simulate_cpu.json
    python scripts/bench/reshard_simulate.py --measured x.json --json out.json

1. A micro-benchmark on `--nproc` local gloo workers (the benchmark's world) describes the
   machine: a small all-reduce (the collective step), concurrent local copies (copy bandwidth,
   and how many cores the workers share), copies of many small views (the cost per copy),
   exchanges through the executor's own shared-memory transport (its bandwidth, its per-round
   cost) and the transport's setup, each at several sizes, with 2 and with all workers busy,
   fitted as a fixed part + bytes / bandwidth.
2. Each transition of the `--measured` reshard benchmark JSONs (scripts/bench/reshard.py) is
   planned again (the plan and rounds the live route ran: its bytes and rounds must match the
   JSON's) and its stall is predicted from the micro-benchmark's description alone, apart from
   the switch constant (the median of the tiny transitions' measured switch) and the build
   and checkpoint constants, which are fitted to the measured JSONs (least squares: no
   micro-benchmark exercises megatron's build or dist_checkpointing).
3. The JSON has the machine's description, the fits, and per transition the predicted and
   measured parts (agree, switch, transfer), stall, stall built at the switch and tmpfs
   checkpoint route, with the errors; and the H100-class cluster's description.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron_ext.reshard import simulate as sim  # noqa: E402

RESULTS = REPO / "scripts" / "bench" / "results"
MEASURED = (RESULTS / "reshard_tiny_cpu.json", RESULTS / "reshard_100m_cpu.json")
COPY_SIZES = (1 << 22, 1 << 24, 1 << 26)  # above the caches: memory, not cache, bandwidth
EXCHANGE_SIZES = (1 << 12, 1 << 20, 1 << 22, 1 << 24, 1 << 26)
TARGET_ERROR = 0.25


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True, help="where the results go")
    p.add_argument("--measured", nargs="+", default=[str(m) for m in MEASURED],
                   help="reshard.py result JSONs whose transitions are predicted")
    p.add_argument("--nproc", type=int, default=4, help="local gloo workers of the micro-benchmark")
    p.add_argument("--repeats", type=int, default=5, help="repeats of each micro-benchmark point (median)")
    args = p.parse_args(argv)
    for path in args.measured:
        if not Path(path).is_file():
            p.error(f"--measured: {path} is not a file")
    if args.nproc < 2:
        p.error("--nproc must be at least 2")
    return args


# --- 1. the micro-benchmark (one gloo worker) ----------------------------------------------------


def worker(repeats: int) -> Optional[dict]:
    import torch.distributed as dist

    from megatron_ext.platform.launch import join_world

    join_world()
    try:
        bench = MicroBench(repeats)
        raw = {"collective": bench.collective()}
        for active in (2, dist.get_world_size()):
            raw[f"copy_{active}"] = {s: bench.copy(s, active) for s in COPY_SIZES}
            raw[f"copy_overhead_{active}"] = bench.small_copies(active)
            raw[f"exchange_{active}"] = {s: bench.exchange(s, active) for s in EXCHANGE_SIZES}
        raw["setup"] = {s: bench.setup(s) for s in EXCHANGE_SIZES}
        return raw if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()


class MicroBench:
    """Timings on every rank at once; each the max over ranks, median over `repeats`."""

    def __init__(self, repeats: int) -> None:
        import torch.distributed as dist

        from megatron_ext.reshard.execute import GroupChannel

        self.repeats = repeats
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.channel = GroupChannel()

    def timed(self, fn, inner: int) -> float:
        """Seconds per call of `fn`, called `inner` times between barriers."""
        import torch
        import torch.distributed as dist

        def once() -> float:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            seconds = torch.tensor([(time.perf_counter() - start) / inner], dtype=torch.float64)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            return seconds.item()

        once()  # warm-up
        return statistics.median(once() for _ in range(self.repeats))

    def collective(self) -> float:
        import torch
        import torch.distributed as dist

        flag = torch.zeros(1, dtype=torch.int64)
        return self.timed(lambda: dist.all_reduce(flag), 50)

    def copy(self, nbytes: int, active: int) -> float:
        """Ranks below `active` each copy `nbytes` from one tensor into another."""
        import torch

        source, target = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
        busy = self.rank < active
        return self.timed(lambda: target.copy_(source) if busy else None, _inner(nbytes))

    def small_copies(self, active: int, count: int = 2000) -> float:
        """Seconds per copy of a 1 KiB 2-D view: what a copy costs apart from its bytes."""
        import torch

        source, target = torch.ones(count * 256), torch.zeros(count * 256)
        busy = self.rank < active

        def copies() -> None:
            if busy:
                for i in range(count):
                    target[i * 256 : (i + 1) * 256].view(16, 16).copy_(source[i * 256 : (i + 1) * 256].view(16, 16))

        return self.timed(copies, 1) / count

    def exchange(self, nbytes: int, active: int) -> float:
        """One round of the executor's shared-memory transport: ranks below `active` in a ring,
        each packs `nbytes` for the next and unpacks what the previous one sent."""
        import torch

        from megatron_ext.reshard.transport import open_shared_memory

        ops = tuple(_op(r, (r + 1) % active, nbytes) for r in range(active))
        transport = open_shared_memory(self.channel, [ops], self.world)
        if transport is None:
            raise RuntimeError("reshard_simulate: the shared-memory transport could not open")
        outgoing = {op.dst: [op] for op in ops if op.src == self.rank}
        incoming = {op.src: [op] for op in ops if op.dst == self.rank}
        source, target = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)

        def one_round() -> None:
            send = transport.send_buffers(outgoing)
            for buffer in send.values():
                buffer.copy_(source)
            for buffer in transport.start(0, send, incoming)().values():
                target.copy_(buffer)
            transport.finish()

        try:
            return self.timed(one_round, _inner(nbytes))
        finally:
            transport.close()

    def setup(self, nbytes: int) -> float:
        """Opening the shared-memory transport for a ring of `nbytes` messages."""
        from megatron_ext.reshard.transport import open_shared_memory

        ops = tuple(_op(r, (r + 1) % self.world, nbytes) for r in range(self.world))
        return self.timed(lambda: open_shared_memory(self.channel, [ops], self.world).close(), 3)


def _op(src: int, dst: int, nbytes: int):
    from megatron_ext.reshard.plan import Op

    return Op(src, dst, None, "param", ((0, nbytes),), 0, 0, nbytes)


def _inner(nbytes: int) -> int:
    return max(3, min(50, (1 << 27) // nbytes))


# --- 2. the machine's description ----------------------------------------------------------------


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares seconds = fixed + bytes * per_byte over (bytes, seconds) points;
    (fixed, per_byte), the fixed part at least 0."""
    xs, ys = [float(x) for x, _ in points], [float(y) for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return max(my - slope * mx, 0.0), slope


def describe_machine(raw: dict, world: int) -> dict:
    """The simulator's link, copy and transport numbers for this machine, from the micro-benchmark."""
    _, copy_per_byte = fit_line(_keyed(raw["copy_2"]))
    _, copy_per_byte_all = fit_line(_keyed(raw[f"copy_{world}"]))
    copy_bandwidth = 1 / copy_per_byte
    # All workers copying at once against two: world / cores times slower per worker.
    cores = min(world, max(1.0, world * copy_per_byte / copy_per_byte_all))
    fixed, per_byte = fit_line(_keyed(raw["exchange_2"]))
    collective_step = raw["collective"] / math.ceil(math.log2(world))
    overhead = raw["copy_overhead_2"]
    # A ring round: two barriers, one message out and one in, a pack and an unpack of each
    # byte (the rank's own core: not duplex).
    barriers = 2 * collective_step * math.ceil(math.log2(world))
    latency = max(0.0, (fixed - barriers - 2 * overhead) / 2)
    setup_fixed, setup_per_byte = fit_line(_keyed(raw["setup"]))
    return {
        "copy_bandwidth": copy_bandwidth,
        "cores_per_node": cores,
        "link_bandwidth": 2 / per_byte,
        "link_latency_s": latency,
        "round_fixed_s": fixed,
        "collective_step_s": collective_step,
        "copy_overhead_s": overhead,
        "setup_s": setup_fixed,
        "setup_bandwidth": 1 / setup_per_byte if setup_per_byte > 0 else math.inf,
    }


def _keyed(points: dict) -> list[tuple[float, float]]:
    return [(int(k), v) for k, v in points.items()]


def machine_cluster(m: dict, world: int, constants: dict) -> sim.Cluster:
    shm = sim.Link(m["link_bandwidth"], m["link_latency_s"], duplex=False)
    return sim.Cluster(
        name="this machine (gloo workers, shared memory)",
        gpus_per_node=world,
        intra=shm,
        inter=shm,  # one host: no inter-node traffic
        copy_bandwidth=m["copy_bandwidth"],
        copy_overhead_s=m["copy_overhead_s"],
        collective_step_s=m["collective_step_s"],
        switch_s=constants["switch_s"],
        build_fixed_s=constants["build_fixed_s"],
        build_bandwidth=constants["build_bandwidth"],
        storage=sim.Storage(
            write_per_node=math.inf,  # tmpfs: memory, the per-rank term decides
            read_per_node=math.inf,
            serialize_bandwidth=constants["serialize_bandwidth"],
            save_fixed_s=constants["save_fixed_s"],
            load_fixed_s=constants["load_fixed_s"],
        ),
        round_collectives=2,  # the shared-memory transport's two barriers per round
        setup_s=m["setup_s"],
        setup_bandwidth=m["setup_bandwidth"],
        cores_per_node=m["cores_per_node"],
        topology="one host: every worker on one node, messages through shared memory",
        sources={
            "link, copy, collective, copy_overhead, setup, cores": "micro-benchmark of this run",
            "switch_s": "median of the tiny transitions' measured switch, less the collective",
            "build, storage": "least squares over the measured transitions (stall built at the "
            "switch less the stall; tmpfs save and load)",
        },
    )


# --- 3. the measured transitions -----------------------------------------------------------------


@dataclasses.dataclass
class Case:
    """One measured transition and what the simulator needs of it."""

    label: str
    model: str
    measured: dict  # the benchmark JSON's transition
    traffic: list
    world: int
    held_a: dict
    held_b: dict
    state: int


def load_cases(paths: list[str]) -> list[Case]:
    """Every in-process transition of the JSONs, planned again as the live route planned it."""
    from megatron_ext.config import compose_config
    from megatron_ext.data import build_tokenizer
    from megatron_ext.models.gpt import padded_vocab_size
    from megatron_ext.reshard.execute import rounds
    from megatron_ext.reshard.plan import plan
    from megatron_ext.reshard.vps import layout_pieces

    vocab = build_tokenizer("byte").vocab_size  # the benchmark's tokenizer
    cases = []
    for path in paths:
        report = json.loads(Path(path).read_text())
        world, budget = report["world"], int(report["budget_mb"] * 2**20)
        for t in report["transitions"]:
            if "(pool)" in t["label"]:
                continue  # moves between worlds: a 'leave' part the in-process model lacks
            base = compose_config([f"model={t['model']}", "experiment=none"]).model
            model = dataclasses.replace(base, vocab_size=padded_vocab_size(vocab, base, 1))
            a, b = (layout_of(side, world) for side in t["label"].split(" → "))
            p = plan(model, a, b)
            steps = rounds(p, budget)
            if p.network_bytes != t["bytes_moved"] or len(steps) != t["rounds"]:
                raise SystemExit(
                    f"{path}: {t['label']} planned again moves {p.network_bytes} bytes in "
                    f"{len(steps)} rounds, the run {t['bytes_moved']} in {t['rounds']}: another planner"
                )
            pieces_a = layout_pieces(model, a)
            cases.append(Case(
                t["label"], t["model"], t, sim.traffic_from_rounds(steps), p.world,
                sim.held_bytes(pieces_a), sim.held_bytes(layout_pieces(model, b)),
                sim.state_bytes(pieces_a),
            ))
    return cases


def layout_of(label: str, world: int):
    """'TP2×PP2' -> ParallelLayout(tp=2, pp=2, dp=world / 4)."""
    from megatron_ext.reshard.layout import ParallelLayout

    sizes = {k.lower(): int(v) for k, v in re.findall(r"(TP|PP|DP|EP|CP)(\d+)", label)}
    sizes.setdefault("dp", world // (sizes.get("tp", 1) * sizes.get("pp", 1) * sizes.get("cp", 1)))
    return ParallelLayout(**sizes, world=world)


def fit_constants(cases: list[Case], m: dict, world: int) -> dict:
    """The constants no micro-benchmark gives: switch, build, checkpoint save and load."""
    collective = m["collective_step_s"] * math.ceil(math.log2(world))
    tiny = [c.measured["parts"]["stall_switch_s"] for c in cases if "tiny" in c.model]
    switch = statistics.median(tiny or [c.measured["parts"]["stall_switch_s"] for c in cases])
    build = [(max(c.held_b.values()), c.measured["stall_built_at_switch_s"] - c.measured["stall_s"]) for c in cases]
    build_fixed, build_per_byte = fit_line(build)
    save = [(max(c.held_a.values()), c.measured["parts"]["ckpt_tmpfs_save_s"]) for c in cases]
    save_fixed, save_per_byte = fit_line(save)
    constants = {
        "switch_s": max(0.0, switch - collective),
        "build_fixed_s": build_fixed,
        "build_bandwidth": 1 / build_per_byte,
        "save_fixed_s": save_fixed,
        "serialize_bandwidth": 1 / save_per_byte,
    }
    # The tmpfs load (build + load) less the build the simulator predicts: the load's own part.
    partial = machine_cluster(m, world, {**constants, "load_fixed_s": 0.0})
    load = [
        c.measured["parts"]["ckpt_tmpfs_load_s"] - sim.build_seconds(c.held_b, partial)
        - max(c.held_b.values()) / constants["serialize_bandwidth"]
        for c in cases
    ]
    return {**constants, "load_fixed_s": max(0.0, statistics.median(load))}


def predict(case: Case, cluster: sim.Cluster) -> dict:
    live = sim.stall(case.traffic, cluster, case.world)
    built = sim.stall(case.traffic, cluster, case.world, case.held_b, built_ahead=False)
    ckpt = sim.checkpoint_route(case.held_a, case.held_b, case.state, cluster)
    t, parts = case.measured, case.measured["parts"]
    rows = {
        "agree_s": (live.agree, parts["stall_agree_s"]),
        "switch_s": (live.switch, parts["stall_switch_s"]),
        "transfer_s": (live.transfer, parts["stall_transfer_s"]),
        # the stall's measured parts less prepare and finish, which the model has not (~0 s)
        "stall_s": (live.total, t["stall_s"]),
        "stall_built_at_switch_s": (built.total, t["stall_built_at_switch_s"]),
        "ckpt_tmpfs_save_s": (ckpt.save, parts["ckpt_tmpfs_save_s"]),
        "ckpt_tmpfs_load_s": (ckpt.build + ckpt.load, parts["ckpt_tmpfs_load_s"]),
        "ckpt_tmpfs_s": (ckpt.total, t["baseline_ckpt_tmpfs_s"]),
    }
    return {
        "label": case.label,
        "model": case.model,
        "bytes_moved": t["bytes_moved"],
        "rounds": t["rounds"],
        **{key: {"predicted": p, "measured": m, "error": p / m - 1} for key, (p, m) in rows.items()},
        "ratio_ckpt_over_stall": {"predicted": ckpt.total / live.total, "measured": t["ratio_ckpt_tmpfs_over_stall"]},
    }


def without_shared_cores(cluster: sim.Cluster) -> sim.Cluster:
    """The same machine with the brief's plain round model: each rank on its own core."""
    return dataclasses.replace(cluster, cores_per_node=None)


def summary(rows: list[dict], key: str) -> dict:
    errors = [abs(r[key]["error"]) for r in rows]
    return {"max_abs_error": max(errors), "median_abs_error": statistics.median(errors),
            "within_25pct": sum(e <= TARGET_ERROR for e in errors), "of": len(errors)}


def print_table(rows: list[dict]) -> None:
    keys = ("agree_s", "switch_s", "transfer_s", "stall_s", "stall_built_at_switch_s", "ckpt_tmpfs_s")
    print(f"{'transition':<22}{'model':<16}" + "".join(f"{k[:-2]:>26}" for k in keys))
    for r in rows:
        cells = "".join(
            f"{r[k]['predicted']:>9.3f}/{r[k]['measured']:<7.3f}{r[k]['error']:>+8.0%} " for k in keys
        )
        print(f"{r['label']:<22}{r['model']:<16}{cells}")


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    from megatron_ext.platform.launch import launch_local

    raw = launch_local(args.nproc, worker, (args.repeats,), "127.0.0.1", 0)[0]
    machine = describe_machine(raw, args.nproc)
    cases = load_cases(args.measured)
    worlds = {c.world for c in cases}
    if worlds != {args.nproc}:
        raise SystemExit(f"--nproc {args.nproc}: the measured runs had {sorted(worlds)} workers")
    constants = fit_constants(cases, machine, args.nproc)
    cluster = machine_cluster(machine, args.nproc, constants)
    rows = [predict(c, cluster) for c in cases]
    plain = [predict(c, without_shared_cores(cluster)) for c in cases]
    print_table(rows)
    out = {
        "benchmark": "scripts/bench/reshard_simulate.py: the stall simulator against reshard.py's measured stalls",
        "measured": [str(Path(p).relative_to(REPO)) if Path(p).is_absolute() else p for p in args.measured],
        "micro_benchmark": raw,
        "machine": machine,
        "constants": constants,
        "cluster": sim.describe(cluster),
        "transitions": rows,
        "summary": {key: summary(rows, key) for key in ("stall_s", "transfer_s", "stall_built_at_switch_s", "ckpt_tmpfs_s")},
        "summary_without_shared_cores": {key: summary(plain, key) for key in ("stall_s", "transfer_s")},
        "h100_class": sim.describe(sim.H100_CLASS),
    }
    Path(args.json).write_text(json.dumps(out, indent=2, default=_json_default) + "\n")
    s = out["summary"]["stall_s"]
    print(f"stall: {s['within_25pct']}/{s['of']} within 25%, max error {s['max_abs_error']:.0%}; wrote {args.json}")
    return 0


def _json_default(value):
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
