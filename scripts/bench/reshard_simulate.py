"""Calibrate the stall simulator (megatron_ext/reshard/simulate.py) on this machine and check it
against measured live reshards.

    python scripts/bench/reshard_simulate.py --json scripts/bench/results/reshard_simulate_cpu.json
    python scripts/bench/reshard_simulate.py --live-models llama_tiny:llama_moe_tiny --measured --json x.json
    python scripts/bench/reshard_simulate.py --reuse earlier.json --json again.json  # predict only

One launch of `--nproc` local gloo workers (the reshard benchmark's world):

1. A micro-benchmark describes the machine: the agreement's collectives as a move runs them
   (execute.py `schedule` on a plan of no ops and the build failures' all-reduce, right after a
   barrier: a move's collective; a small all-reduce after a copy in a quiet loop is kept as a
   check); copies by one worker alone (its copy bandwidth), by as many workers as there are
   cores at once (the node's memory bandwidth, all together) and by all workers; exchanges
   through the executor's own shared-memory transport
   (its bandwidth), every copy reading and writing places not touched lately (buffers larger
   than the caches, walked through: a move's state is not in the cache), and the first round
   on a transport just opened (its arenas' pages touched first: the extra per byte over its
   later rounds is the first-touch rate); the transport's setup;
   each at several sizes and fitted as a fixed part + bytes / bandwidth; one element of each
   piece of a llama_tiny trainer's state read and written back through megatron's state access
   (the cost of a copy apart from its bytes); and the switch's own work on that trainer (a
   layout built beforehand installed: `LayoutController.install`). Cores: the CPUs this process may run
   on.
2. In the same run, live reshards of the benchmark's transitions (scripts/bench/reshard.py's
   TRANSITIONS, each chain closed into a cycle and run `--live-repeats` times) for each model
   pair of `--live-models`: prepare (plan, build B ahead), wait, barrier, reshard; each part of
   the stall the max over ranks, the median over repeats.
3. Each transition, of this run and of the `--measured` reshard.py JSONs (other runs, other
   load on this shared machine), is planned again (its bytes and rounds must match: a stored
   run of another planner is skipped) and predicted from the micro-benchmark's description,
   with each rank's round cutting in the agreement timed on its own plan here, after the
   workers are gone (`cut_seconds`: pure functions; --reuse takes the earlier run's). The build
   and checkpoint constants are fitted to the `--measured` JSONs (least squares: no
   micro-benchmark exercises megatron's build or dist_checkpointing), so their errors are fits,
   not predictions.

The JSON has the micro-benchmark, the machine's description, per transition the predicted and
measured parts (agree, switch, transfer), stall (and where measured the stall built at the
switch and the tmpfs checkpoint route) with errors and the timed round cutting, the same move on
the H100-class cluster, summaries per source, the stall of each transition here against the
stored runs' (`run_to_run`, and `run_to_run_spread` counted as the errors are: the machine's
own spread), and every live move's record.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
for path in (REPO, REPO / "scripts" / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from megatron_ext.reshard import simulate as sim  # noqa: E402
from provenance import provenance  # noqa: E402  (scripts/bench/provenance.py, beside this script)

RESULTS = REPO / "scripts" / "bench" / "results"
MEASURED = (RESULTS / "reshard_tiny_cpu.json", RESULTS / "reshard_100m_cpu.json")
COPY_SIZES = (1 << 20, 1 << 22, 1 << 24, 1 << 26)
EXCHANGE_SIZES = (1 << 12, 1 << 20, 1 << 22, 1 << 24, 1 << 26)
FIRST_ROUND_SIZES = (1 << 20, 1 << 22, 1 << 24, 1 << 26)
# Copies read and write places walked through buffers of this size, larger than the caches (this
# host's L3 is 300 MiB, shared): a move reads and writes state it has not touched lately.
COLD_BYTES = 1 << 29
TARGET_ERROR = 0.25
LIVE_PARTS = ("agree", "switch", "transfer")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True, help="where the results go")
    p.add_argument("--measured", nargs="*", default=[str(m) for m in MEASURED],
                   help="reshard.py result JSONs whose transitions are predicted too")
    p.add_argument("--live-models", nargs="*", default=["llama_tiny:llama_moe_tiny", "llama_100m:llama_moe_100m"],
                   help="DENSE:MOE model presets whose transitions are measured live in this run")
    p.add_argument("--live-repeats", type=int, default=3, help="cycles of each chain measured live")
    p.add_argument("--budget-mb", type=float, default=64.0, help="the live moves' staging budget")
    p.add_argument("--nproc", type=int, default=4, help="local gloo workers")
    p.add_argument("--repeats", type=int, default=5, help="repeats of each micro-benchmark point (median)")
    p.add_argument("--reuse", help="an earlier --json of this script: predict again from its "
                   "micro-benchmark and live moves instead of measuring")
    args = p.parse_args(argv)
    for path in [*args.measured, *([args.reuse] if args.reuse else [])]:
        if not Path(path).is_file():
            p.error(f"--measured / --reuse: {path} is not a file")
    for pair in args.live_models:
        if pair.count(":") != 1:
            p.error(f"--live-models: {pair!r} is not DENSE:MOE")
    if args.nproc < 2:
        p.error("--nproc must be at least 2")
    if args.live_repeats < 1 or args.repeats < 1:
        p.error("--live-repeats and --repeats must be at least 1")
    return args


# --- 1. the micro-benchmark and 2. the live moves (one gloo worker) ------------------------------


def worker(args: argparse.Namespace) -> Optional[dict]:
    import torch.distributed as dist

    from megatron_ext.platform.launch import join_world

    join_world()
    try:
        bench = MicroBench(args.repeats)
        cores = min(len(os.sched_getaffinity(0)), dist.get_world_size())
        raw = {"collective": bench.collective(), "agree": bench.agree(), "cores": cores}
        for active in sorted({1, cores, dist.get_world_size()}):
            raw[f"copy_{active}"] = {s: bench.copy(s, active) for s in COPY_SIZES}
        for active in sorted({2, cores, dist.get_world_size()}):  # a ring of at least two
            raw[f"exchange_{active}"] = {s: bench.exchange(s, active) for s in EXCHANGE_SIZES}
        ring = max(2, cores)
        raw[f"first_round_{ring}"] = {s: bench.first_round(s, ring) for s in FIRST_ROUND_SIZES}
        raw["setup"] = {s: bench.setup(s) for s in EXCHANGE_SIZES}
        raw["copy_overhead"], raw["switch"] = bench.state_copies_and_switch(active=cores)  # a core each
        bench.release()
        live = [m for pair in args.live_models for m in live_moves(pair, args)]
        return {"micro_benchmark": raw, "live": live} if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()


class MicroBench:
    """Timings on every rank at once; each the max over ranks, the median of `repeats`."""

    def __init__(self, repeats: int) -> None:
        import torch.distributed as dist

        from megatron_ext.reshard.execute import GroupChannel

        self.repeats = repeats
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.channel = GroupChannel()
        self.cold = ColdPlaces()

    def timed(self, fn, inner: int) -> float:
        """Seconds per call of `fn`, called `inner` times between barriers."""
        import torch.distributed as dist

        def once() -> float:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            return _max_over_ranks((time.perf_counter() - start) / inner)

        once()  # warm-up
        return statistics.median(once() for _ in range(self.repeats))

    def collective(self, samples: int = 30) -> float:
        """A one-element all-reduce as a move meets it: right after every rank copied 4 MiB,
        from the end of this rank's copy to the end of the all-reduce (the ranks' skew counts)."""
        import torch
        import torch.distributed as dist

        flag = torch.zeros(1, dtype=torch.int64)
        source, target = torch.ones(1 << 22, dtype=torch.uint8), torch.zeros(1 << 22, dtype=torch.uint8)

        def once() -> float:
            dist.barrier()
            target.copy_(source)
            start = time.perf_counter()
            dist.all_reduce(flag)
            return _max_over_ranks(time.perf_counter() - start)

        return statistics.median(once() for _ in range(samples))

    def agree(self, samples: int = 30) -> float:
        """The agreement's collectives as a move runs them (live.py: right after the ranks left
        a barrier, execute.py `schedule`, then the all-reduce of the build failures), on a plan
        of no ops, so that no rank has rounds to cut: the max over ranks of that part, the
        median of `samples` (as many as the collective's: a move's agreement is a few ms, and
        its spread on shared cores as large)."""
        import torch
        import torch.distributed as dist

        from megatron_ext.parallel.layout import ParallelLayout
        from megatron_ext.reshard.execute import schedule
        from megatron_ext.reshard.plan import RankPlan

        layout = ParallelLayout(dp=self.world, world=self.world)
        nothing = RankPlan(layout, layout, self.rank, (), "micro-benchmark")

        def once() -> float:
            dist.barrier()
            start = time.perf_counter()
            schedule(nothing, 1 << 20, self.channel)
            dist.all_reduce(torch.zeros(1, dtype=torch.int64))
            return _max_over_ranks(time.perf_counter() - start)

        once()  # warm-up
        return statistics.median(once() for _ in range(samples))

    def copy(self, nbytes: int, active: int) -> float:
        """Ranks below `active` each copy `nbytes` from a place not touched lately to another."""
        busy = self.rank < active

        def once() -> None:
            if busy:
                target, source = self.cold.next(nbytes)
                target.copy_(source)

        return self.timed(once, _inner(nbytes))

    def release(self) -> None:
        self.cold = None

    def exchange(self, nbytes: int, active: int) -> float:
        """One round of the executor's shared-memory transport: ranks below `active` in a ring,
        each packs `nbytes` for the next, a barrier, each unpacks what the previous one sent."""
        from megatron_ext.reshard.transport import open_shared_memory

        outgoing, incoming = self._ring(nbytes, active)
        transport = open_shared_memory(self.channel, [(outgoing, incoming)], self.world)
        if transport is None:
            raise RuntimeError("reshard_simulate: the shared-memory transport could not open")

        def one_round() -> None:
            target, source = self.cold.next(nbytes)  # the state packed from, unpacked into
            _ring_round(transport, outgoing, incoming, source, target)

        try:
            return self.timed(one_round, _inner(nbytes))
        finally:
            transport.close()

    def first_round(self, nbytes: int, active: int) -> float:
        """`exchange`'s round, but the first one on a transport just opened (its arenas' pages
        not touched yet, as in a move): the opening not timed; the max over ranks, the median
        of `repeats`."""
        import torch.distributed as dist

        from megatron_ext.reshard.transport import open_shared_memory

        outgoing, incoming = self._ring(nbytes, active)

        def once() -> float:
            transport = open_shared_memory(self.channel, [(outgoing, incoming)], self.world)
            try:
                target, source = self.cold.next(nbytes)
                dist.barrier()
                start = time.perf_counter()
                _ring_round(transport, outgoing, incoming, source, target)
                return _max_over_ranks(time.perf_counter() - start)
            finally:
                transport.close()

        once()  # warm-up
        return statistics.median(once() for _ in range(self.repeats))

    def setup(self, nbytes: int) -> float:
        """Opening the shared-memory transport for a ring of `nbytes` messages."""
        from megatron_ext.reshard.transport import open_shared_memory

        by_round = [self._ring(nbytes, self.world)]
        return self.timed(lambda: open_shared_memory(self.channel, by_round, self.world).close(), 3)

    def _ring(self, nbytes: int, active: int) -> tuple[dict, dict]:
        """This rank's messages of one round (by peer, out and in) of a ring of ranks below
        `active`, each sending `nbytes` to the next."""
        ops = [_op(r, (r + 1) % active, nbytes) for r in range(active)]
        return ({op.dst: [op] for op in ops if op.src == self.rank},
                {op.src: [op] for op in ops if op.dst == self.rank})

    def state_copies_and_switch(self, active: int) -> tuple[float, float]:
        """On a llama_tiny trainer: (seconds per copy apart from its bytes, the switch's work).

        A copy as the executor makes it: one element of each piece of the state read and
        written back through megatron's state access (state_access.py), on ranks below
        `active`; half of a read + write: a network op is a read and a pack on one rank, an
        unpack and a write on another. The switch as a move's is, apart from its success
        report: the old state's access made, a layout built beforehand installed
        (`LayoutController.prepare`, `install`), the new optimizer's states ensured; every rank at once, the max
        over ranks, the median of `repeats` switches to the layout the trainer runs."""
        import torch.distributed as dist

        from megatron_ext.platform.device import current_device
        from megatron_ext.reshard.live import planner_model
        from megatron_ext.reshard.state_access import MegatronState, ensure_optimizer_states
        from megatron_ext.reshard.vps import rank_pieces

        trainer = _trainer("llama_tiny", {}, self.world)
        try:
            ensure_optimizer_states(trainer.optimizer)
            state = MegatronState(trainer.model, trainer.optimizer)
            layout = _layout(trainer.cfg.parallel)
            pieces = rank_pieces(planner_model(trainer), layout, self.rank)
            corners = [(p, tuple((lo, lo + 1) for lo, _ in p.box)) for p in pieces]

            def copies() -> None:
                if self.rank < active:
                    for piece, box in corners:
                        state.write(piece, box, state.read(piece, box))

            per_copy = self.timed(copies, 5) / max(len(corners), 1) / 2
            switches = []
            for _ in range(self.repeats):
                built = trainer.layout_controller.prepare(trainer.cfg.parallel, current_device())
                dist.barrier()
                start = time.perf_counter()
                ensure_optimizer_states(trainer.optimizer)
                MegatronState(trainer.model, trainer.optimizer)
                trainer.layout_controller.install(built)
                ensure_optimizer_states(trainer.optimizer)
                switches.append(_max_over_ranks(time.perf_counter() - start))
            return per_copy, statistics.median(switches)
        finally:
            trainer.close()


class ColdPlaces:
    """(target, source) views of `nbytes` that walk two buffers of COLD_BYTES each, so that
    consecutive copies touch places the caches no longer hold."""

    def __init__(self) -> None:
        import torch

        self.source = torch.ones(COLD_BYTES, dtype=torch.uint8)
        self.target = torch.zeros(COLD_BYTES, dtype=torch.uint8)
        self.offset = 0

    def next(self, nbytes: int):
        if self.offset + nbytes > COLD_BYTES:
            self.offset = 0
        place = slice(self.offset, self.offset + nbytes)
        self.offset += nbytes
        return self.target[place], self.source[place]


def live_moves(pair: str, args: argparse.Namespace) -> list[dict]:
    """The benchmark's chains on the models `pair` (DENSE:MOE), each closed into a cycle and run
    `args.live_repeats` times: one record per move, its stall's parts max over ranks."""
    import reshard as bench  # scripts/bench/reshard.py

    dense, moe = pair.split(":")
    records = []
    for chain in bench.parse_chains(";".join(bench.TRANSITIONS)):
        model = moe if any(sizes.get("ep", 1) > 1 for sizes in chain) else dense
        cycle = chain if chain[-1] == chain[0] else [*chain, chain[0]]
        trainer = _trainer(model, cycle[0], args.nproc)
        try:
            trainer.train_step()  # real Adam moments and step
            for _ in range(args.live_repeats):
                for a, b in zip(cycle, cycle[1:]):
                    records.append(_live_move(trainer, a, b, model, args.budget_mb))
        finally:
            trainer.close()
            bench.return_free_memory()
    return records


def _live_move(trainer, a: dict, b: dict, model: str, budget_mb: float) -> dict:
    """One move as reshard.py's live route makes it: prepared (plan, build B ahead), waited
    for, every rank's stall starting together. The previous move's layout is released first
    (release.py's thread: its collection takes a core for a tenth of a second or more): moves
    here follow one another at once, where reshard.py runs its other routes in between."""
    import torch.distributed as dist

    import reshard as bench
    from megatron_ext.parallel.release import wait_released
    from megatron_ext.reshard.config import target_config
    from megatron_ext.reshard.live import prepare, reshard

    base = dataclasses.replace(trainer.cfg.parallel, tp=1, pp=1, ep=1, cp=1, vpp=None)
    target = target_config(base, b)
    wait_released()
    bench.return_free_memory()
    prepared = prepare(trainer, target, budget_mb)
    prepared.result()
    dist.barrier()
    report = reshard(trainer, target, budget_mb, prepared)
    seconds = {f"{name}_s": _max_over_ranks(report.stall_parts[name]) for name in LIVE_PARTS}
    return {
        "label": f"{bench.label(a)} → {bench.label(b)}",
        "model": model,
        "bytes_moved": report.network_bytes,
        "rounds": report.rounds,
        "stall_s": _max_over_ranks(report.stall_seconds),
        **seconds,
    }


def _trainer(model: str, sizes: dict, world: int):
    import reshard as bench
    from megatron_ext.config import compose_config
    from megatron_ext.training.trainer import Trainer

    trainer = Trainer(compose_config(bench.overrides(model, sizes, world)), [])
    trainer.setup()
    return trainer


def _layout(parallel):
    import torch.distributed as dist

    from megatron_ext.parallel.layout import ParallelLayout

    return ParallelLayout.from_config(parallel, dist.get_world_size())


def _ring_round(transport, outgoing, incoming, source, target) -> None:
    """One round of the ring through `transport`: pack `source` into each message to send, and
    unpack each message received into `target`."""
    send = transport.send_buffers(outgoing)
    for buffer in send.values():
        buffer.copy_(source)
    for buffer in transport.start(0, send, incoming)().values():
        target.copy_(buffer)
    transport.finish()


def _max_over_ranks(value: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _op(src: int, dst: int, nbytes: int):
    from megatron_ext.reshard.plan import Op

    return Op(src, dst, None, "param", ((0, nbytes),), 0, 0, nbytes)


def _inner(nbytes: int) -> int:
    return max(5, min(50, (1 << 28) // nbytes))


# --- 3. the machine's description and the predictions --------------------------------------------


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares seconds = fixed + bytes * per_byte over (bytes, seconds) points;
    (fixed, per_byte), the fixed part at least 0."""
    xs, ys = [float(x) for x, _ in points], [float(y) for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return max(my - slope * mx, 0.0), slope


def describe_machine(raw: dict, world: int) -> dict:
    """The simulator's link, copy and transport numbers for this machine, from the micro-benchmark."""
    steps, cores = math.ceil(math.log2(world)), raw["cores"]
    # Copies by one worker alone (its own rate), by as many as there are cores (the node's
    # memory, all of them together), by all workers (a check: the cores they found).
    _, copy_per_byte = fit_line(_keyed(raw["copy_1"]))
    _, copy_per_byte_cores = fit_line(_keyed(raw[f"copy_{cores}"]))
    _, copy_per_byte_all = fit_line(_keyed(raw[f"copy_{world}"]))
    fixed, per_byte = fit_line(_keyed(raw[f"exchange_{cores}"]))
    # A move's collectives cost what its agreement's do (each rank arriving after its own work,
    # on cores the other workers share): the bare collective of a quiet loop is kept as a check.
    collective_step = raw["agree"] / sim.AGREE_COLLECTIVES / steps
    # The first round on fresh arenas against the same ring's later rounds: the extra is the
    # first touch of a worker's own arena (written) and its peer's (read), 2 bytes a byte.
    ring = max(2, cores)
    _, first_per_byte = fit_line(_keyed(raw[f"first_round_{ring}"]))
    _, warm_per_byte = fit_line(_keyed(raw[f"exchange_{ring}"]))
    touch_per_byte = (first_per_byte - warm_per_byte) / 2
    # A ring round of the phased transport: a barrier after packing, one after unpacking (in a
    # loop: the bare collective's); a pack and an unpack per byte, every worker of the ring at
    # once. Its fixed part less those is the latency of a message. Its bytes are copies into and
    # out of shared memory, as fast as a worker's copies: the link's bandwidth is the copy
    # bandwidth (the exchange's own per-byte rate, with every worker of the ring copying at
    # once, is the node's memory's).
    latency = max(0.0, fixed - 2 * raw["collective"] - 2 * raw["copy_overhead"]) / 2
    setup_fixed, setup_per_byte = fit_line(_keyed(raw["setup"]))
    return {
        "copy_bandwidth": 1 / copy_per_byte,
        "node_copy_bandwidth": cores / copy_per_byte_cores,
        "cores_per_node": cores,
        # all workers copying at once against one a core: how many cores the copies found
        "cores_seen_by_copies": world * copy_per_byte_cores / copy_per_byte_all,
        "link_bandwidth": 1 / copy_per_byte,
        "exchange_bandwidth_per_worker": 2 / per_byte,  # a check: the ring's workers at once
        "link_latency_s": latency,
        "exchange_fixed_s": fixed,
        "collective_step_s": collective_step,
        "loop_collective_step_s": raw["collective"] / steps,  # a check: a collective in a quiet loop
        "touch_bandwidth": 1 / touch_per_byte if touch_per_byte > 0 else math.inf,
        "copy_overhead_s": raw["copy_overhead"],
        "switch_s": raw["switch"],
        "setup_s": setup_fixed,
        "setup_bandwidth": 1 / setup_per_byte if setup_per_byte > 0 else math.inf,
    }


def _keyed(points: dict) -> list[tuple[float, float]]:
    return [(int(k), v) for k, v in points.items()]


def machine_cluster(m: dict, world: int, constants: dict) -> sim.Cluster:
    shm = sim.Link(m["link_bandwidth"], m["link_latency_s"], duplex=False)
    return sim.Cluster(
        name="this machine: gloo workers, messages through shared memory",
        gpus_per_node=world,
        intra=shm,
        inter=shm,  # one host: no inter-node traffic
        copy_bandwidth=m["copy_bandwidth"],
        copy_overhead_s=m["copy_overhead_s"],
        collective_step_s=m["collective_step_s"],
        switch_s=m["switch_s"],
        build_fixed_s=constants["build_fixed_s"],
        build_bandwidth=constants["build_bandwidth"],
        storage=sim.Storage(
            write_per_node=math.inf,  # tmpfs is memory: the per-rank term decides
            read_per_node=math.inf,
            serialize_bandwidth=constants["serialize_bandwidth"],
            save_fixed_s=constants["save_fixed_s"],
            load_fixed_s=constants["load_fixed_s"],
        ),
        round_collectives=2,  # the shared-memory transport's barriers per round
        phased=True,  # every rank packs, a barrier, every rank unpacks
        setup_s=m["setup_s"],
        setup_bandwidth=m["setup_bandwidth"],
        touch_bandwidth=m["touch_bandwidth"],
        cores_per_node=m["cores_per_node"],
        node_copy_bandwidth=m["node_copy_bandwidth"],
        topology="one host: every worker on one node, messages through shared memory",
        sources={
            "links, copies, collective, copy_overhead, setup, switch_s": "the micro-benchmark of this run",
            "cores_per_node": "the CPUs this process may run on",
            "node_copy_bandwidth": "the micro-benchmark's copies by as many workers as cores, all together",
            "build, storage": "least squares over the --measured transitions (stall built at the "
            "switch less the stall; tmpfs save; tmpfs load less the build)",
        },
    )


@dataclasses.dataclass
class Case:
    """One measured transition, normalised, and what the simulator needs of it."""

    source: str  # "this run" or the JSON it came from
    measured: dict  # label, model, bytes_moved, rounds, <part>_s, stall_s [, built, ckpt]
    traffic: list
    world: int
    held_a: dict
    held_b: dict
    state: int
    cut: dict  # rank -> seconds of cutting its own rounds in the agreement (cut_seconds)


def stored_transitions(path: str) -> tuple[int, float, list[dict]]:
    """(world, budget MiB, transitions) of a reshard.py JSON, normalised as the live records."""
    report = json.loads(Path(path).read_text())
    out = []
    for t in report["transitions"]:
        if "(pool)" in t["label"]:
            continue  # moves between worlds: a 'leave' part that in-process moves have not
        parts = t["parts"]
        out.append({
            "label": t["label"], "model": t["model"], "bytes_moved": t["bytes_moved"], "rounds": t["rounds"],
            "stall_s": t["stall_s"], **{f"{n}_s": parts[f"stall_{n}_s"] for n in LIVE_PARTS},
            "stall_built_at_switch_s": t["stall_built_at_switch_s"],
            "ckpt_tmpfs_save_s": parts["ckpt_tmpfs_save_s"], "ckpt_tmpfs_load_s": parts["ckpt_tmpfs_load_s"],
            "ckpt_tmpfs_s": t["baseline_ckpt_tmpfs_s"],
        })
    return report["world"], report["budget_mb"], out


def median_records(records: list[dict]) -> list[dict]:
    """One record per (model, transition): the median of each time over its repeats."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["model"], r["label"]), []).append(r)
    return [
        {**rs[0], **{k: statistics.median(r[k] for r in rs) for k in rs[0] if k.endswith("_s")},
         "repeats": len(rs)}
        for rs in groups.values()
    ]


def cases_of(source: str, world: int, budget_mb: float, transitions: list[dict], cuts: dict) -> list[Case]:
    """Each transition planned again as its live move planned it, its round cutting timed
    (`cut_seconds`) or taken from `cuts` ((source, model, label) -> rank -> seconds: timed
    by the run --reuse reads)."""
    from megatron_ext.config import compose_config
    from megatron_ext.data import build_tokenizer
    from megatron_ext.models.gpt import padded_vocab_size
    from megatron_ext.reshard.execute import rounds
    from megatron_ext.reshard.plan import plan
    from megatron_ext.reshard.vps import layout_pieces

    vocab = build_tokenizer("byte").vocab_size  # the benchmark's tokenizer
    cases = []
    for t in transitions:
        base = compose_config([f"model={t['model']}", "experiment=none"]).model
        model = dataclasses.replace(base, vocab_size=padded_vocab_size(vocab, base, 1))
        a, b = (layout_of(side, world) for side in t["label"].split(" → "))
        p = plan(model, a, b)
        steps = rounds(p, int(budget_mb * 2**20))
        if p.network_bytes != t["bytes_moved"] or len(steps) != t["rounds"]:
            why = (f"{source}: {t['label']} planned again moves {p.network_bytes} bytes in {len(steps)} "
                   f"rounds, the run {t['bytes_moved']} in {t['rounds']}: another planner")
            if source == "this run":
                raise SystemExit(why)
            print(f"skipped: {why}", file=sys.stderr)  # a stored run of an older planner
            continue
        pieces_a = layout_pieces(model, a)
        cut = cuts.get((source, t["model"], t["label"])) or cut_seconds(model, a, b, int(budget_mb * 2**20))
        cases.append(Case(
            source, t, sim.traffic_from_rounds(steps), p.world, sim.held_bytes(pieces_a),
            sim.held_bytes(layout_pieces(model, b)), sim.state_bytes(pieces_a), cut,
        ))
    return cases


def cut_seconds(model, a, b, budget_bytes: int, repeats: int = 5) -> dict[int, float]:
    """Each rank's work between the agreement's first two collectives (execute.py `schedule`):
    its byte counts (`traffic`), its own rounds from every rank's (`rank_rounds`), its staging
    peak (`peak_bytes`), on its own plan; pure functions, timed here one rank after another
    (one core), the median of `repeats`."""
    from megatron_ext.reshard.execute import peak_bytes, rank_rounds, traffic
    from megatron_ext.reshard.plan import rank_plan

    world = max(a.world, b.world)
    plans = [rank_plan(model, a, b, r) for r in range(world)]
    everyone = [traffic(p, r) for r, p in enumerate(plans)]

    def once(rank: int) -> float:
        start = time.perf_counter()
        traffic(plans[rank], rank)
        peak_bytes(plans[rank], rank_rounds(plans[rank], rank, budget_bytes, everyone))
        return time.perf_counter() - start

    return {r: statistics.median(once(r) for _ in range(repeats)) for r in range(world)}


def earlier_cuts(path: Optional[str]) -> dict:
    """(source, model, label) -> rank -> seconds: the round cutting an earlier --json timed."""
    if not path:
        return {}
    rows = json.loads(Path(path).read_text())["transitions"]
    return {(r["source"], r["model"], r["label"]): {int(k): v for k, v in r["agree_cut_s"].items()}
            for r in rows if "agree_cut_s" in r}


def layout_of(label: str, world: int):
    """'TP2×PP2' -> ParallelLayout(tp=2, pp=2, dp=world / 4)."""
    from megatron_ext.parallel.layout import ParallelLayout

    sizes = {k.lower(): int(v) for k, v in re.findall(r"(TP|PP|DP|EP|CP)(\d+)", label)}
    sizes.setdefault("dp", world // (sizes.get("tp", 1) * sizes.get("pp", 1) * sizes.get("cp", 1)))
    return ParallelLayout(**sizes, world=world)


def fit_constants(stored: list[Case], m: dict, world: int) -> dict:
    """The constants no micro-benchmark gives: build, checkpoint save and load."""
    if not stored:  # nothing measured them: the fit has no data
        return {"build_fixed_s": math.nan, "build_bandwidth": math.nan,
                "save_fixed_s": math.nan, "serialize_bandwidth": math.nan, "load_fixed_s": math.nan}
    build = [(max(c.held_b.values()), c.measured["stall_built_at_switch_s"] - c.measured["stall_s"]) for c in stored]
    build_fixed, build_per_byte = fit_line(build)
    save = [(max(c.held_a.values()), c.measured["ckpt_tmpfs_save_s"]) for c in stored]
    save_fixed, save_per_byte = fit_line(save)
    constants = {"build_fixed_s": build_fixed, "build_bandwidth": 1 / build_per_byte,
                 "save_fixed_s": save_fixed, "serialize_bandwidth": 1 / save_per_byte}
    # The tmpfs load (build + load) less the build and the per-rank term: the load's fixed part.
    partial = machine_cluster(m, world, {**constants, "load_fixed_s": 0.0})
    load = [
        c.measured["ckpt_tmpfs_load_s"] - sim.build_seconds(c.held_b, partial)
        - max(c.held_b.values()) / constants["serialize_bandwidth"]
        for c in stored
    ]
    return {**constants, "load_fixed_s": max(0.0, statistics.median(load))}


def predict(case: Case, cluster: sim.Cluster) -> dict:
    live = sim.stall(case.traffic, cluster, case.world, cut=case.cut)
    predicted = {"agree_s": live.agree, "switch_s": live.switch, "transfer_s": live.transfer, "stall_s": live.total}
    t = case.measured
    if "stall_built_at_switch_s" in t:
        built = sim.stall(case.traffic, cluster, case.world, case.held_b, built_ahead=False, cut=case.cut)
        ckpt = sim.checkpoint_route(case.held_a, case.held_b, case.state, cluster)
        predicted.update(stall_built_at_switch_s=built.total, ckpt_tmpfs_save_s=ckpt.save,
                         ckpt_tmpfs_load_s=ckpt.build + ckpt.load, ckpt_tmpfs_s=ckpt.total)
    row = {"source": case.source, "label": t["label"], "model": t["model"], "bytes_moved": t["bytes_moved"],
           "rounds": t["rounds"], "repeats": t.get("repeats", 1), "agree_cut_s": case.cut}
    # The predicted stall is agree + switch + transfer; the measured one also has prepare and
    # finish (waiting for a finished preparation, handing the old layout to a thread: ~0).
    for key, p in predicted.items():
        row[key] = {"predicted": p, "measured": t[key], "error": p / t[key] - 1}
    row["h100_class"] = on_h100(case)
    return row


def on_h100(case: Case) -> dict:
    """The same move's stall and checkpoint route on the H100-class cluster (one node here; the
    ranks' round cutting as timed here: the same Python on the GPU hosts' cores)."""
    live = sim.stall(case.traffic, sim.H100_CLASS, case.world, cut=case.cut)
    ckpt = sim.checkpoint_route(case.held_a, case.held_b, case.state, sim.H100_CLASS)
    return {"stall_s": live.total, "transfer_s": live.transfer, "ckpt_s": ckpt.total,
            "ratio_ckpt_over_stall": ckpt.total / live.total}


def run_to_run(rows: list[dict]) -> list[dict]:
    """The same transition's stall measured in this run and in a stored run: how much the
    machine alone moves a measurement."""
    here = {(r["model"], r["label"]): r["stall_s"]["measured"] for r in rows if r["source"] == "this run"}
    return [
        {"label": r["label"], "model": r["model"], "stored": r["source"], "this_run_s": here[key],
         "stored_s": r["stall_s"]["measured"], "ratio": here[key] / r["stall_s"]["measured"]}
        for r in rows
        if r["source"] != "this run" and (key := (r["model"], r["label"])) in here
    ]


def spread(pairs: list[dict]) -> dict:
    """Per stored run, how far the stalls measured here are from its (this run / stored - 1),
    counted as `summary` counts a prediction's errors: what the machine alone does."""
    by_source: dict[str, list[float]] = {}
    for pair in pairs:
        by_source.setdefault(pair["stored"], []).append(abs(pair["ratio"] - 1))
    return {source: _counted(errors) for source, errors in by_source.items()}


def summary(rows: list[dict], key: str) -> dict:
    errors = [abs(r[key]["error"]) for r in rows if key in r]
    return _counted(errors) if errors else {}


def _counted(errors: list[float]) -> dict:
    return {"max_abs_error": max(errors), "median_abs_error": statistics.median(errors),
            "within_25pct": sum(e <= TARGET_ERROR for e in errors), "of": len(errors)}


SUMMARISED = ("stall_s", "agree_s", "switch_s", "transfer_s", "stall_built_at_switch_s", "ckpt_tmpfs_s")
PRINTED = ("agree_s", "switch_s", "transfer_s", "stall_s", "ckpt_tmpfs_s")


def print_table(rows: list[dict]) -> None:
    print(f"{'source':<26}{'transition':<22}{'model':<16}" + "".join(f"{k[:-2]:>25}" for k in PRINTED))
    for r in rows:
        cells = "".join(
            f"{r[k]['predicted']:>8.3f}/{r[k]['measured']:<7.3f}{r[k]['error']:>+7.0%}  " if k in r else f"{'-':>25}"
            for k in PRINTED
        )
        print(f"{r['source'][-25:]:<26}{r['label']:<22}{r['model']:<16}{cells}")


def measure(args: argparse.Namespace) -> dict:
    """The micro-benchmark and the live moves: run now, or those of an earlier run (--reuse)."""
    if args.reuse:
        earlier = json.loads(Path(args.reuse).read_text())
        if "agree" not in earlier["micro_benchmark"]:
            raise SystemExit(f"--reuse: {args.reuse} is of an older micro-benchmark (no 'agree' "
                             "timing): measure again")
        # the measurements' own record: where, when and on which code they were taken
        reused_from = {"file": Path(args.reuse).name, **earlier.get("provenance", {})}
        return {"micro_benchmark": earlier["micro_benchmark"], "live": earlier["live_moves"], "reused_from": reused_from}
    from megatron_ext.platform.launch import launch_local

    return launch_local(args.nproc, worker, (args,), "127.0.0.1", 0)[0]


def summaries(rows: list[dict]) -> dict:
    by_source: dict[str, list[dict]] = {}
    for r in rows:
        by_source.setdefault(r["source"], []).append(r)
    return {s: {k: summary(rs, k) for k in SUMMARISED} for s, rs in by_source.items()}


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    ran = measure(args)
    machine = describe_machine(ran["micro_benchmark"], args.nproc)
    cuts = earlier_cuts(args.reuse)
    live = cases_of("this run", args.nproc, args.budget_mb, median_records(ran["live"]), cuts)
    stored = []
    for path in args.measured:
        world, budget, transitions = stored_transitions(path)
        if world != args.nproc:
            raise SystemExit(f"--measured: {path} ran {world} workers, this run --nproc {args.nproc}")
        stored += cases_of(str(Path(path).name), world, budget, transitions, cuts)
    constants = fit_constants(stored, machine, args.nproc)
    cluster = machine_cluster(machine, args.nproc, constants)
    rows = [predict(c, cluster) for c in live + stored]
    print_table(rows)
    out = {
        "benchmark": "scripts/bench/reshard_simulate.py: the stall simulator against measured live reshards",
        "world": args.nproc,
        "live_models": args.live_models,
        "live_repeats": args.live_repeats,
        "measured": [Path(p).name for p in args.measured],
        "micro_benchmark": ran["micro_benchmark"],
        "machine": machine,
        "constants": constants,
        "cluster": sim.describe(cluster),
        "transitions": rows,
        "summary": summaries(rows),
        "run_to_run": run_to_run(rows),
        "run_to_run_spread": spread(run_to_run(rows)),
        "live_moves": ran["live"],
        "h100_class": sim.describe(sim.H100_CLASS),
        "provenance": provenance(__file__, argv),
    }
    if "reused_from" in ran:
        out["reused_from"] = ran["reused_from"]
    Path(args.json).write_text(json.dumps(sim.jsonable(out), indent=2) + "\n")
    for source, parts in out["summary"].items():
        for part in LIVE_PARTS + ("stall",):
            if s := parts.get(f"{part}_s"):
                print(f"{source}: {part} within 25% in {s['within_25pct']}/{s['of']}, "
                      f"median error {s['median_abs_error']:.0%}, max {s['max_abs_error']:.0%}")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
