"""Live reshard against the routes to a new layout that exist today: same state, same A -> B.

    python scripts/bench/reshard.py --json reshard.json --plot reshard.png
    python scripts/bench/reshard.py --model llama_tiny --transitions 'tp2,pp2->dp4' --repeats 1 \
        --json x.json
    torchrun --nproc-per-node 4 scripts/bench/reshard.py --json reshard.json

One launch of `--nproc` local CPU workers (or the world torchrun made). For each chain of layouts
in the transition table a fresh Trainer starts in the chain's first layout and trains `--steps`
steps, so that the Adam moments and the step are real. Each arrow A -> B of the chain is one
transition, measured on every route from the same training state:

  live        megatron_ext.reshard.live.prepare(trainer, B, budget) (plan, and build B beside A:
              groups, model, optimizer), waited for, then reshard(trainer, B, budget, prepared):
              its report's stall and prepare seconds, network bytes, measured staging peak and
              its bound
  live_built  the live route with B built at the switch instead (no prebuild): its stall only
  live_msgs   the live route with the state sent as gloo messages instead of through shared
              memory (reshard.shared_memory=false): its stall only
  gather      all-gather then slice: LayoutController.install(B), then every state of every logical
              tensor is all-gathered whole over the world and each rank copies out its pieces of B
  ckpt_tmpfs  trainer.save() in A into /dev/shm (megatron dist_checkpointing, the optimizer fully
              reshardable), LayoutController.install(B), checkpointing/torch_dist.load_checkpoint
  ckpt_disk   the same through a directory on disk, with os.sync() after the save
  restart     what users do today: the disk save, then a new job of new processes in B that
              resumes from a disk checkpoint of the same state (restart_probe.py) until every
              rank is ready to step; run after the chain, when this job holds no model any more

The routes after the live one first return the trainer to A, loading a checkpoint saved at the
start of the transition. A route's time is the max over ranks (the live stall: of the report's
stall_seconds); the JSON gives the median over `--repeats`. The state each other route leaves in
B is compared bitwise with the live route's on every rank: params, fp32 main params, exp_avg,
exp_avg_sq, step, scheduler and counters. `bytes_min` is what B's pieces need that their rank
does not hold in A, counted over the VPS pieces' logical coordinates apart from the planner.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import gc
import hashlib
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core.utils import unwrap_model  # noqa: E402

from megatron_ext.config import compose_config  # noqa: E402
from megatron_ext.config.schema import ModelConfig, ParallelConfig  # noqa: E402
from megatron_ext.config.validate import ConfigError, validate  # noqa: E402
from megatron_ext.parallel.layout import ParallelLayout  # noqa: E402
from megatron_ext.platform.launch import join_world, launch_local  # noqa: E402
from megatron_ext.platform.launch_env import detect_launch  # noqa: E402
from megatron_ext.reshard.boxes import Box, box_shape, numel  # noqa: E402
from megatron_ext.reshard.config import target_config  # noqa: E402
from megatron_ext.reshard.live import prepare, reshard  # noqa: E402
from megatron_ext.reshard.state_access import MegatronState, ensure_optimizer_states  # noqa: E402
from megatron_ext.reshard.vps import Piece, layout_pieces, rank_pieces  # noqa: E402
from megatron_ext.checkpointing import torch_dist as ckpt  # noqa: E402
from megatron_ext.training.trainer import Trainer, TrainState  # noqa: E402
from extras import require  # noqa: E402  (scripts/bench/extras.py, beside this script)
from provenance import provenance  # noqa: E402  (scripts/bench/provenance.py, beside this script)

# The measured transitions: one chain of layouts of the same world per line. Each arrow is one
# transition, started from the state the previous one left; a chain that ends where it began
# also checks that the round trip gives back its starting state bitwise. A layout names its
# sizes (tp, pp, dp, ep, cp): the others are 1, and dp, unless named, is what the world leaves.
# Chains that name ep run on the MoE model (--moe-model); ep divides dp (megatron's rule), so
# ep2 on 4 workers is EP2 x expert-DP2.
TRANSITIONS = (
    "tp2,pp2->dp4->tp2,pp2",
    "dp4->tp4->dp4",
    "tp2,dp2->pp2,dp2->tp2,pp2",
    "ep2->ep4->ep2",
)

STATE_EQUAL = "state_equal: live == checkpoint routes == live built at the switch, bitwise"
# A target holds for a transition (True), not (False), or does not apply to it (None: e.g. a
# pool transition has no in-process checkpoint routes to compare with).


def at_least(key: str, factor: float) -> Callable[[dict], Optional[bool]]:
    return lambda t: t[key] >= factor if key in t else None


TARGETS: dict[str, Callable[[dict], Optional[bool]]] = {
    "bytes_moved == bytes_min": lambda t: t["bytes_moved"] == t["bytes_min"] if "bytes_min" in t else None,
    "peak_extra_bytes <= peak_bound_bytes": (
        lambda t: t["peak_extra_bytes"] <= t["peak_bound_bytes"]
    ),
    "stall >= 10x shorter than the tmpfs checkpoint route": at_least("ratio_ckpt_tmpfs_over_stall", 10),
    "stall >= 100x shorter than a restart": at_least("ratio_restart_over_stall", 100),
    STATE_EQUAL: lambda t: t.get("state_equal"),
    "round trip A -> B -> A gives back A's state bitwise": lambda t: t.get("round_trip_equal"),
}

# The parts of a live stall (ReshardReport.stall_parts), in order.
STALL_PARTS = ("prepare", "agree", "switch", "transfer", "finish")

# Per-trial times reported, as medians, under "parts".
PARTS = (
    *(f"stall_{name}_s" for name in STALL_PARTS),
    "ckpt_tmpfs_save_s",
    "ckpt_tmpfs_load_s",
    "ckpt_disk_save_s",
    "ckpt_disk_load_s",
    "restart_launch_s",
)

# Chains that change the number of workers: run by the job itself (the worker pool of the
# reshard plugin), launched with as many workers as the chain's largest layout.
POOL_TRANSITIONS = ("dp4->dp2->dp4",)

SIZE = re.compile(r"(tp|pp|dp|ep|cp)(\d+)")

# What torchrun (or launch_local's elastic agent) told this worker about its own world; the
# restarted job is a new launch and must not inherit it.
LAUNCHER_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
)


# --- the command line ----------------------------------------------------------------------------


def parse_layout(text: str) -> dict[str, int]:
    """'tp2,pp2' -> {'tp': 2, 'pp': 2}."""
    sizes = {key: int(value) for key, value in SIZE.findall(text)}
    if not sizes or SIZE.sub("", text).strip(" ,"):
        raise argparse.ArgumentTypeError(f"cannot read the layout {text!r}; write e.g. tp2,pp2")
    return sizes


def parse_chains(text: str) -> list[list[dict[str, int]]]:
    """'tp2,pp2->dp4;dp4->tp4' -> [[{tp: 2, pp: 2}, {dp: 4}], [{dp: 4}, {tp: 4}]]; 'none' -> []."""
    if text.strip() == "none":
        return []
    chains = [
        [parse_layout(layout) for layout in chain.split("->")]
        for chain in text.split(";")
        if chain.strip()
    ]
    if not chains or any(len(chain) < 2 for chain in chains):
        raise argparse.ArgumentTypeError(f"{text!r}: each chain needs at least one '->'")
    return chains


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True, help="where the results go")
    p.add_argument("--plot", help="a PNG bar chart of the stall against the baselines (log scale)")
    p.add_argument("--nproc", type=int, default=4, help="local workers (ignored under torchrun)")
    p.add_argument("--model", default="llama_100m", help="model preset of the dense chains")
    p.add_argument("--moe-model", default="llama_moe_100m", help="model preset of chains naming ep")
    p.add_argument("--transitions", type=parse_chains, default=";".join(TRANSITIONS),
                   help="chains of layouts, e.g. 'tp2,pp2->dp4->tp2,pp2;ep2->ep4' "
                   "(default: the table in this file)")
    p.add_argument("--pool-transitions", type=parse_chains, default=";".join(POOL_TRANSITIONS),
                   help="chains that change the number of workers, e.g. 'dp4->dp2->dp4' "
                   "(local launches only; 'none' to skip)")
    p.add_argument("--repeats", type=int, default=3, help="trials per transition (JSON: medians)")
    p.add_argument("--steps", type=int, default=1,
                   help="training steps before a chain's first transition")
    p.add_argument("--pool-steps-between", type=int, default=10,
                   help="training steps before each move of a pool chain (after --steps): the "
                   "job prepares the move (builds its new world) in the background meanwhile")
    p.add_argument("--budget-mb", type=float, default=64.0,
                   help="the live reshard's staging budget per round")
    p.add_argument("--ckpt-dir", help="where the disk checkpoints go (default: a temp dir in /tmp)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def overrides(model: str, sizes: dict[str, int], world: int) -> list[str]:
    """The run's config: short sequences and one micro-batch per DP rank, since only the size
    of the state matters here (the cost of a step does not)."""
    return [
        f"model={model}",
        "experiment=none",
        f"launcher.nproc={world}",
        "model.seq_length=64",
        "train.micro_batch_size=1",
        f"train.global_batch_size={world}",
        "train.iters=100",
        "train.eval_interval=0",
        "logging.progress_bar=false",
        *(f"parallel.{key}={value}" for key, value in sizes.items()),
    ]


def chain_model(chain: list[dict[str, int]], args: argparse.Namespace) -> str:
    return args.moe_model if any(sizes.get("ep", 1) > 1 for sizes in chain) else args.model


def check_layouts(args: argparse.Namespace, world: int) -> None:
    """Refuse, before anything runs, a layout the runtime's rules reject for its model."""
    for chain in args.transitions:
        for sizes in chain:
            validate(compose_config(overrides(chain_model(chain, args), sizes, world)), world)
    for chain in args.pool_transitions:
        for sizes in chain:
            n = workers(sizes)
            validate(compose_config(overrides(chain_model(chain, args), sizes, n)), n)


def label(sizes: dict[str, int]) -> str:
    """{'tp': 2, 'pp': 2} -> 'TP2×PP2'."""
    return "×".join(f"{key.upper()}{value}" for key, value in sizes.items())


def spec(chain: list[dict[str, int]]) -> str:
    """The chain as --transitions writes it."""
    return "->".join(",".join(f"{key}{value}" for key, value in sizes.items()) for sizes in chain)


# --- one rank: chains, transitions, trials -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Dirs:
    """Checkpoint directories, the same on every rank."""

    shm: Path  # in /dev/shm: the tmpfs route's
    disk: Path  # in /tmp or --ckpt-dir: the disk route's and the references

    @classmethod
    def create(cls, disk_parent: Optional[str]) -> "Dirs":
        made: list = [None]
        if dist.get_rank() == 0:
            if disk_parent:
                os.makedirs(disk_parent, exist_ok=True)
            made[0] = cls(
                Path(tempfile.mkdtemp(prefix="reshard_bench_", dir="/dev/shm")),
                Path(tempfile.mkdtemp(prefix="reshard_bench_", dir=disk_parent)),
            )
        dist.broadcast_object_list(made, src=0)
        return made[0]

    def reference(self, hop: int) -> Path:
        """The state in A of a chain's transition `hop`: each of its routes starts from there, and
        its restarts resume from there."""
        return self.disk / f"reference{hop}"

    def remove(self) -> None:
        for path in (self.shm, self.disk):
            shutil.rmtree(path, ignore_errors=True)


@dataclasses.dataclass
class Hop:
    """One transition of a chain, as measured so far."""

    label: str
    trials: list[dict]  # per repeat; the restart's time joins them last
    bytes_min: Optional[int]  # counted on rank 0 only
    round_trip_equal: Optional[bool] = None  # on the last transition of a chain back to its start


def worker(args: argparse.Namespace) -> Optional[dict]:
    """One rank of the benchmark; rank 0 writes the results and returns them."""
    join_world()
    rank = dist.get_rank()
    machine = {
        "world": dist.get_world_size(),
        "backend": dist.get_backend(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
    }
    dirs = Dirs.create(args.ckpt_dir)
    chains = []
    try:
        for chain in args.transitions:
            chains.append(run_chain(chain, args, dirs))
            if rank == 0:  # what is done so far survives a crash of a long run
                write_json(args, summarize(args, machine, chains))
    finally:
        if rank == 0:
            dirs.remove()
        dist.destroy_process_group()
    return summarize(args, machine, chains) if rank == 0 else None


def run_chain(chain: list[dict[str, int]], args: argparse.Namespace, dirs: Dirs) -> dict:
    """The chain's transitions by every in-process route; then their restarts, once this job
    holds no model: a restart's new processes and this job's old ones together would not fit in
    a small machine's memory."""
    model = chain_model(chain, args)
    hops, size = in_process_routes(chain, model, args, dirs)
    return_free_memory()
    world = dist.get_world_size()
    for i, (hop, b) in enumerate(zip(hops, chain[1:])):
        probe = overrides(model, b, world)
        for trial in hop.trials:
            launch_s = restart_launch(probe, dirs.reference(i))
            trial["restart_launch_s"] = over_ranks({"s": launch_s}, dist.ReduceOp.MAX)["s"]
        clear(dirs.reference(i))
    transitions = [aggregate(hop) for hop in hops]
    return {"chain": spec(chain), "model": model, "size": size, "transitions": transitions}


def in_process_routes(
    chain: list[dict[str, int]], model: str, args: argparse.Namespace, dirs: Dirs
) -> tuple[list[Hop], dict]:
    """A fresh trainer in the chain's first layout, a few steps, then each transition by the
    live, all-gather and checkpoint routes. Returns the transitions and the model's size."""
    trainer = Trainer(compose_config(overrides(model, chain[0], dist.get_world_size())), [])
    try:
        trainer.setup()
        for _ in range(args.steps):
            trainer.train_step()
        round_trip = chain[-1] == chain[0]
        start = fingerprint(trainer) if round_trip else None
        hops = []
        for i, (a, b) in enumerate(zip(chain, chain[1:])):
            trials, live, bytes_min = measure(trainer, b, args, dirs, dirs.reference(i))
            hops.append(Hop(f"{label(a)} → {label(b)}", trials, bytes_min))
        if round_trip:
            hops[-1].round_trip_equal = agree(live == start)
        return hops, state_size(trainer)
    finally:
        return_free_memory()
        trainer.close()


def measure(
    trainer: Trainer, b: dict[str, int], args: argparse.Namespace, dirs: Dirs, reference: Path
) -> tuple[list[dict], dict, Optional[int]]:
    """The in-process routes from the trainer's layout to `b`, `args.repeats` times, each from
    the state saved in `reference`. Returns the trials, the fingerprint of this rank's state
    after the live route, and bytes_min (on rank 0)."""
    source = trainer.cfg.parallel
    target = target_config(dataclasses.replace(source, tp=1, pp=1, ep=1, cp=1, vpp=None), b)
    clear(reference)
    trainer_save(trainer, reference)
    trials = []
    for repeat in range(args.repeats):
        if repeat:
            back_to(trainer, source, reference)
        trial, live = run_trial(trainer, source, target, args.budget_mb, dirs, reference)
        trials.append(trial)
    bytes_min = None
    if dist.get_rank() == 0:  # a pure count, the same on every rank: one rank makes it
        bytes_min = minimum_bytes(planning_model(trainer), layout(source), layout(target))
    return trials, live, bytes_min


def run_trial(
    trainer: Trainer,
    source: ParallelConfig,
    target: ParallelConfig,
    budget_mb: float,
    dirs: Dirs,
    reference: Path,
) -> tuple[dict, dict]:
    """Each in-process route once, from the trainer in `source` holding the state saved in
    `reference`, to which the routes after the live one first return."""
    return_free_memory()
    prepared = prepare(trainer, target, budget_mb)
    prepared.result()  # training would go on meanwhile; here the stall alone is measured
    dist.barrier()  # every rank's stall starts together
    report = reshard(trainer, target, budget_mb, prepared)
    live = fingerprint(trainer)
    back_to(trainer, source, reference)
    dist.barrier()
    built = reshard(trainer, target, budget_mb)
    built_equal = fingerprint(trainer) == live
    back_to(trainer, source, reference)
    prepared = prepare(trainer, target, budget_mb)
    prepared.result()
    dist.barrier()
    messages = reshard(trainer, target, budget_mb, prepared, shared_memory=False)
    messages_equal = fingerprint(trainer) == live
    back_to(trainer, source, reference)
    gather_s, gather_bytes = timed(lambda: gather_and_slice(trainer, target))
    gather_equal = fingerprint(trainer) == live
    back_to(trainer, source, reference)
    tmpfs = checkpoint_route(trainer, target, dirs.shm / "ckpt", sync=False)
    tmpfs_equal = fingerprint(trainer) == live
    back_to(trainer, source, reference)
    disk = checkpoint_route(trainer, target, dirs.disk / "ckpt", sync=True)
    disk_equal = fingerprint(trainer) == live
    seconds = over_ranks({
        "stall_s": report.stall_seconds,
        "stall_built_at_switch_s": built.stall_seconds,
        "stall_messages_s": messages.stall_seconds,
        **{f"stall_{name}_s": report.stall_parts[name] for name in STALL_PARTS},
        "prepare_s": report.prepare_seconds,
        "peak_extra_bytes": report.peak_extra_bytes,
        "baseline_gather_s": gather_s,
        "ckpt_tmpfs_save_s": tmpfs[0],
        "ckpt_tmpfs_load_s": tmpfs[1],
        "ckpt_disk_save_s": disk[0],
        "ckpt_disk_load_s": disk[1],
    }, dist.ReduceOp.MAX)
    trial = {
        "from": report.source,
        "to": report.target,
        "bytes_moved": report.network_bytes,
        "rounds": report.rounds,
        "peak_bound_bytes": report.peak_bound_bytes,
        "gather_bytes": gather_bytes,
        **seconds,
        "transport": report.transport,
        "state_equal": agree(tmpfs_equal and disk_equal and built_equal and messages_equal),
        "gather_state_equal": agree(gather_equal),
    }
    return trial, live


# --- getting in and out of layouts ---------------------------------------------------------------


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds of `fn` on this rank, between barriers so that all ranks start and end it
    together; what `fn` returned)."""
    dist.barrier()
    start = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - start, out


def return_free_memory() -> None:
    """Collect garbage and hand freed heap memory back to the OS (glibc keeps it otherwise), so
    that each route, and a restart's new processes, find the memory this job no longer uses."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: nothing to trim
        pass


def back_to(trainer: Trainer, parallel: ParallelConfig, root: Path) -> None:
    """Return the trainer to layout `parallel` and the state checkpointed in `root` (untimed)."""
    return_free_memory()
    switch_and_load(trainer, parallel, root)
    return_free_memory()


def clear(root: Path) -> None:
    """Remove `root`, so that the next save writes a new checkpoint rather than replacing one."""
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()


def trainer_save(trainer: Trainer, root: Path) -> None:
    """`trainer.save()` into `root` (the trainer's config names where checkpoints go)."""
    checkpoint = dataclasses.replace(trainer.cfg.checkpoint, save=str(root))
    trainer.cfg = dataclasses.replace(trainer.cfg, checkpoint=checkpoint)
    trainer.save()


def switch_and_load(trainer: Trainer, parallel: ParallelConfig, root: Path) -> None:
    """Build `parallel` and load the newest checkpoint of `root` into it, as a resumed run does:
    tensors, scheduler and counters."""
    trainer.layout_controller.install(ParallelLayout.from_config(parallel, dist.get_world_size()))
    gc.collect()  # the old layout's objects, before loading: a restarted job would not hold them
    iteration = ckpt.latest_iteration(root)
    common = ckpt.load_checkpoint(root, iteration, trainer.model, trainer.optimizer, load_rng=False)
    # install carried the scheduler over in memory; megatron's load_state_dict adds the
    # saved steps to a scheduler's own, so the checkpoint's goes into a new one (as in setup).
    trainer.scheduler = trainer._build_scheduler()
    trainer.scheduler.load_state_dict(common["scheduler"])
    trainer.state = TrainState(common["iteration"], common["consumed_samples"])
    trainer.layout_controller.commit()  # filled: a live move that fails later rolls back to it


# --- the baselines -------------------------------------------------------------------------------


def checkpoint_route(
    trainer: Trainer, target: ParallelConfig, root: Path, sync: bool
) -> tuple[float, float]:
    """(save seconds, rebuild + load seconds) of going to `target` through a checkpoint."""
    clear(root)
    if sync and dist.get_rank() == 0:
        os.sync()  # earlier writes (the last checkpoint's removal) are not this save's to flush

    def save_and_sync() -> None:
        trainer_save(trainer, root)
        if sync and dist.get_rank() == 0:
            os.sync()

    seconds = timed(save_and_sync)[0], timed(lambda: switch_and_load(trainer, target, root))[0]
    clear(root)  # a tmpfs checkpoint is memory
    return seconds


def restart_launch(probe: list[str], root: Path) -> float:
    """Seconds from starting a new job (restart_probe.py with config `probe`) that resumes from
    the disk checkpoint in `root` until every one of its ranks is ready; measured on rank 0, 0
    elsewhere. This job's workers wait meanwhile; a restarted job's would have exited."""
    return restart_seconds(probe, root) if dist.get_rank() == 0 else 0.0


def restart_seconds(probe: list[str], root: Path) -> float:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in LAUNCHER_VARIABLES and not key.startswith("TORCHELASTIC_")
    }
    script = Path(__file__).with_name("restart_probe.py")
    command = [sys.executable, str(script), *probe, f"checkpoint.load={root}"]
    start = time.time()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the restarted job failed:\n{done.stderr[-20000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["ready_at"] - start


def gather_and_slice(trainer: Trainer, target: ParallelConfig) -> int:
    """Build `target`, then fill it: each state of each logical tensor is all-gathered whole
    from the pieces of layout A, and every rank copies out its pieces of B. Returns the bytes
    the world received."""
    model = planning_model(trainer)
    held = by_tensor(layout_pieces(model, layout(trainer.cfg.parallel)))
    wanted = by_tensor(rank_pieces(model, layout(target), dist.get_rank()))
    ensure_optimizer_states(trainer.optimizer)
    old = MegatronState(trainer.model, trainer.optimizer)
    trainer.layout_controller.install(ParallelLayout.from_config(target, dist.get_world_size()))
    ensure_optimizer_states(trainer.optimizer)
    new = MegatronState(trainer.model, trainer.optimizer)
    received = 0
    for key, pieces in held.items():
        whole, nbytes = all_gather_whole(pieces, old.read)
        received += nbytes
        for piece in wanted.get(key, ()):
            new.write(piece, piece.box, whole[box_slices(piece.box)])
    trainer.layout_controller.commit()  # filled: a live move that fails later rolls back to it
    return received


def all_gather_whole(
    pieces: list[Piece], read: Callable[[Piece, Box], torch.Tensor]
) -> tuple[torch.Tensor, int]:
    """The logical tensor assembled on every rank from every rank's `pieces` of it, and the
    bytes the world received for it. gloo gathers equal sizes: each rank sends the most any
    rank holds."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, pieces[0].dtype)
    size = max(sum(numel(p.box) for p in pieces if p.rank == r) for r in range(world))
    mine = torch.zeros(size, dtype=dtype)
    own = [read(p, p.box).reshape(-1) for p in pieces if p.rank == rank]
    if own:
        torch.cat(own, out=mine[: sum(t.numel() for t in own)])
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    whole = torch.empty(pieces[0].shape, dtype=dtype)
    offsets: dict[int, int] = defaultdict(int)
    for p in pieces:
        n, start = numel(p.box), offsets[p.rank]
        whole[box_slices(p.box)] = everyone[p.rank][start : start + n].view(box_shape(p.box))
        offsets[p.rank] += n
    return whole, world * (world - 1) * mine.numel() * mine.element_size()


def by_tensor(pieces: tuple[Piece, ...]) -> dict[tuple, list[Piece]]:
    """Pieces grouped by (logical tensor, state), in the VPS order (the same on every rank)."""
    grouped: dict[tuple, list[Piece]] = defaultdict(list)
    for piece in pieces:
        grouped[(piece.name, piece.state)].append(piece)
    return grouped


def box_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box)


def planning_model(trainer: Trainer) -> ModelConfig:
    """The model as the planner sees it: with the run's padded vocabulary (fixed for the run)."""
    return dataclasses.replace(trainer.cfg.model, vocab_size=trainer.vocab_size)


def layout(parallel: ParallelConfig) -> ParallelLayout:
    return ParallelLayout.from_config(parallel, dist.get_world_size())


# --- state: equality, size, bytes ----------------------------------------------------------------


def state_tensors(trainer: Trainer) -> Iterator[tuple[tuple, torch.Tensor]]:
    """Every training-state tensor of this rank, keyed the same way in any route's objects: the
    model's params by chunk and name, and for each param the distributed optimizer's entries
    (fp32 main param, exp_avg, exp_avg_sq, step), as megatron's own accessor returns them."""
    names = {}
    for i, chunk in enumerate(trainer.model):
        for name, param in unwrap_model(chunk).named_parameters():
            names[param] = (i, name)
            yield ("model", i, name), param
    for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        for param in opt.model_param_group_index_map:
            for key, tensor in opt._get_main_param_and_optimizer_states(param).items():
                yield ("optimizer", *names[param], key), tensor


def counters(trainer: Trainer) -> tuple:
    return trainer.state.iteration, trainer.state.consumed_samples, trainer.scheduler.state_dict()


def fingerprint(trainer: Trainer) -> dict:
    """This rank's training state, each tensor as (dtype, shape, SHA-256 of its bytes), and its
    counters: two states are bitwise equal when their fingerprints are. (Copies of a 100M-param
    state would not fit beside the routes on a 24 GB machine.)"""

    def digest(tensor: torch.Tensor) -> tuple:
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        return str(tensor.dtype), tuple(tensor.shape), hashlib.sha256(data).hexdigest()

    prints = {key: digest(tensor) for key, tensor in state_tensors(trainer)}
    return {**prints, "counters": counters(trainer)}


def state_size(trainer: Trainer) -> dict[str, int]:
    """The model's parameters and the bytes of its training state (every state once)."""
    tensors = {
        (p.name, p.state): (math.prod(p.shape), getattr(torch, p.dtype).itemsize)
        for p in layout_pieces(planning_model(trainer), layout(trainer.cfg.parallel))
    }
    return {
        "params": sum(n for (_, state), (n, _) in tensors.items() if state == "param"),
        "state_bytes": sum(n * itemsize for n, itemsize in tensors.values()),
    }


def minimum_bytes(model: ModelConfig, a: ParallelLayout, b: ParallelLayout) -> int:
    """Bytes of layout `b`'s pieces that their rank does not hold in layout `a`: per destination
    piece, what the same rank's pieces of the same state in `a` leave uncovered must come over
    the network. Written apart from the planner (plan.py), which claims to move exactly this."""
    held = defaultdict(list)
    for piece in layout_pieces(model, a):
        held[(piece.rank, piece.name, piece.state)].append(piece.box)
    return sum(
        missing(piece.box, held[(piece.rank, piece.name, piece.state)])
        * getattr(torch, piece.dtype).itemsize
        for piece in layout_pieces(model, b)
    )


def missing(box: Box, held: list[Box]) -> int:
    """Elements of `box` that none of the `held` boxes covers. The boxes' edges cut `box` into a
    grid of cells that each lie wholly inside or outside every held box; a boolean mask over the
    cells marks the covered ones, and the uncovered cells' volumes add up."""
    edges = []
    for d, (start, stop) in enumerate(box):
        inner = {min(max(edge, start), stop) for other in held for edge in other[d]}
        edges.append(np.array(sorted({start, stop, *inner})))
    covered = np.zeros([len(e) - 1 for e in edges], dtype=bool)
    for other in held:
        # Clipped to `box`, a held box's edges are grid edges; a disjoint one selects nothing.
        covered[tuple(
            slice(np.searchsorted(e, max(start, o_start)), np.searchsorted(e, min(stop, o_stop)))
            for e, (start, stop), (o_start, o_stop) in zip(edges, box, other)
        )] = True
    volume = functools.reduce(np.multiply.outer, [np.diff(e) for e in edges])
    return int(volume[~covered].sum())


def over_ranks(values: dict[str, float], op: dist.ReduceOp) -> dict[str, float]:
    """`values` reduced over the ranks with `op`."""
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return dict(zip(keys, t.tolist()))


def agree(flag: bool) -> bool:
    """True when `flag` is true on every rank."""
    return bool(over_ranks({"flag": flag}, dist.ReduceOp.MIN)["flag"])


# --- chains that change the number of workers: the job itself -----------------------------------


def workers(sizes: dict[str, int]) -> int:
    return math.prod(sizes.get(key, 1) for key in ("tp", "pp", "dp", "cp"))


def hydra_list(entries: list[dict]) -> str:
    """[{'step': 2, 'layout': {'dp': 2}}] as a Hydra override value: [{step: 2, layout: {dp: 2}}]."""

    def value(v: Any) -> str:
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k}: {value(x)}" for k, x in v.items()) + "}"
        return str(v)

    return "[" + ", ".join(value(e) for e in entries) + "]"


def run_pool_chain(chain: list[dict[str, int]], args: argparse.Namespace) -> list[dict]:
    """The chain, `--repeats` times over, in ONE training job (megatron_ext.train's run with the
    reshard plugin): its reshard reports give stall, planning and bytes. The baseline is what a
    job does today to run on another number of workers: stop, then a new job of new processes in
    B resumes from a disk checkpoint (restart_probe.py, timed until every rank is ready; the save
    before it is not counted, which favours the baseline)."""
    from megatron_ext.train import run_from_overrides

    model, pool = chain_model(chain, args), max(workers(sizes) for sizes in chain)
    hops = list(zip(chain, chain[1:])) * args.repeats
    gap = args.pool_steps_between + 1
    first = args.steps + gap  # the first move, too, has the steps between to be built ahead
    schedule = [{"step": first + i * gap, "layout": b} for i, (_, b) in enumerate(hops)]
    tmp = Path(tempfile.mkdtemp(prefix="reshard_pool_", dir=args.ckpt_dir))
    try:
        moves, ckpt = tmp / "moves.jsonl", tmp / "ckpt"
        job = [o for o in overrides(model, chain[0], pool) if not o.startswith("train.iters=")]
        run_from_overrides(
            [*job, "plugins=[reshard]",
             f"reshard.schedule={hydra_list(schedule)}", f"reshard.report_file={moves}",
             f"reshard.memory_budget_mb={args.budget_mb}", f"train.iters={first + len(hops) * gap}",
             f"checkpoint.save={ckpt}"]
        )
        reports = [json.loads(line) for line in moves.read_text().splitlines()]
        out = []
        for a, b in zip(chain, chain[1:]):
            mine = [r for r, (x, y) in zip(reports, hops) if (x, y) == (a, b)]
            restarts = [restart_seconds(overrides(model, b, workers(b)), ckpt) for _ in mine]
            out.append(pool_transition(a, b, mine, restarts))
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def pool_transition(a: dict, b: dict, reports: list[dict], restarts: list[float]) -> dict:
    stall = statistics.median(r["stall_seconds"] for r in reports)
    restart = statistics.median(restarts)
    return {
        "label": f"{label(a)} → {label(b)} (pool)",
        "from": reports[0]["source"],
        "to": reports[0]["target"],
        "stall_s": stall,
        "prepare_s": statistics.median(r["prepare_seconds"] for r in reports),
        "built_ahead": all(r["built_ahead"] for r in reports),
        "bytes_moved": reports[0]["network_bytes"],
        "rounds": reports[0]["rounds"],
        "transport": reports[0]["transport"],
        "peak_extra_bytes": max(r["peak_extra_bytes"] for r in reports),
        "peak_bound_bytes": reports[0]["peak_bound_bytes"],
        "baseline_restart_s": restart,
        "ratio_restart_over_stall": restart / stall,
        "parts": {
            f"stall_{name}_s": statistics.median(r["stall_parts"][name] for r in reports)
            for name in reports[0]["stall_parts"]
        },
        "trials": [{"report": r, "restart_launch_s": s} for r, s in zip(reports, restarts)],
    }


# --- results -------------------------------------------------------------------------------------


def aggregate(hop: Hop) -> dict:
    """A transition's results from its trials: medians of times, the worst peak, all-of
    equalities, and the ratios of each baseline to the stall."""
    trials = hop.trials

    def med(f: Callable[[dict], float]) -> float:
        return statistics.median(f(t) for t in trials)

    first = trials[0]
    out = {
        "label": hop.label,
        "from": first["from"],
        "to": first["to"],
        "stall_s": med(lambda t: t["stall_s"]),
        "stall_built_at_switch_s": med(lambda t: t["stall_built_at_switch_s"]),
        "stall_messages_s": med(lambda t: t["stall_messages_s"]),
        "transport": first["transport"],
        "prepare_s": med(lambda t: t["prepare_s"]),
        "prepare_first_s": first["prepare_s"],
        "bytes_moved": first["bytes_moved"],
        "bytes_min": hop.bytes_min,
        "rounds": first["rounds"],
        "peak_extra_bytes": int(max(t["peak_extra_bytes"] for t in trials)),
        "peak_bound_bytes": first["peak_bound_bytes"],
        "baseline_ckpt_tmpfs_s": med(lambda t: t["ckpt_tmpfs_save_s"] + t["ckpt_tmpfs_load_s"]),
        "baseline_ckpt_disk_s": med(lambda t: t["ckpt_disk_save_s"] + t["ckpt_disk_load_s"]),
        "baseline_restart_s": med(lambda t: t["ckpt_disk_save_s"] + t["restart_launch_s"]),
        "baseline_gather_s": med(lambda t: t["baseline_gather_s"]),
        "gather_bytes": first["gather_bytes"],
        "state_equal": all(t["state_equal"] for t in trials),
        "gather_state_equal": all(t["gather_state_equal"] for t in trials),
        "round_trip_equal": hop.round_trip_equal,
        "parts": {part: med(lambda t: t[part]) for part in PARTS},  # noqa: B023 (called here)
    }
    for name in ("ckpt_tmpfs", "ckpt_disk", "restart", "gather"):
        out[f"ratio_{name}_over_stall"] = out[f"baseline_{name}_s"] / out["stall_s"]
    out["trials"] = trials
    return out


def summarize(args: argparse.Namespace, machine: dict, chains: list[dict]) -> dict:
    transitions = [
        {"chain": c["chain"], "model": c["model"], **t} for c in chains for t in c["transitions"]
    ]
    return {
        "benchmark": "scripts/bench/reshard.py: live reshard vs checkpoint, restart, all-gather",
        "world": machine["world"],
        "repeats": args.repeats,
        "steps_before": args.steps,
        "pool_steps_between": args.pool_steps_between,
        "budget_mb": args.budget_mb,
        "machine": machine,
        "models": {c["model"]: c["size"] for c in chains},
        "transitions": transitions,
        "targets": check_targets(transitions),
    }


def check_targets(transitions: list[dict]) -> dict[str, dict]:
    out = {}
    for name, check in TARGETS.items():
        verdicts = [(t["label"], check(t)) for t in transitions]
        checked = [(where, ok) for where, ok in verdicts if ok is not None]
        missed = [where for where, ok in checked if not ok]
        out[name] = {"met": not missed, "checked": len(checked), "missed": missed}
    return out


def write_json(args: argparse.Namespace, report: dict) -> None:
    Path(args.json).write_text(json.dumps({**report, "provenance": provenance(__file__, args.argv)}, indent=2) + "\n")


def write_outputs(args: argparse.Namespace, report: dict) -> None:
    write_json(args, report)
    print_table(report)
    if args.plot:
        plot(report, args.plot)
    print(f"wrote {args.json}" + (f" and {args.plot}" if args.plot else ""))


# The printed table's columns after the transition: heading -> cell.
COLUMNS: dict[str, Callable[[dict], str]] = {
    "stall": lambda t: f"{t['stall_s']:.2f}",
    "switch": lambda t: f"{t['parts']['stall_switch_s']:.2f}",
    "w/o pre": lambda t: f"{t['stall_built_at_switch_s']:.2f}",
    "msgs": lambda t: f"{t['stall_messages_s']:.2f}",
    "prepare": lambda t: f"{t['prepare_s']:.2f}",
    "gather": lambda t: f"{t['baseline_gather_s']:.2f}",
    "tmpfs": lambda t: f"{t['baseline_ckpt_tmpfs_s']:.2f}",
    "disk": lambda t: f"{t['baseline_ckpt_disk_s']:.2f}",
    "restart": lambda t: f"{t['baseline_restart_s']:.2f}",
    "tmpfs/": lambda t: f"{t['ratio_ckpt_tmpfs_over_stall']:.1f}x",
    "restart/": lambda t: f"{t['ratio_restart_over_stall']:.1f}x",
    "MiB": lambda t: f"{t['bytes_moved'] / 2**20:.1f}",
    "min MiB": lambda t: f"{t['bytes_min'] / 2**20:.1f}",
    "equal": lambda t: "yes" if t["state_equal"] else "NO",
}


def cell_text(cell: Callable[[dict], str], transition: dict) -> str:
    try:
        return cell(transition)
    except KeyError:  # a route this transition does not have
        return "-"


def print_table(report: dict) -> None:
    print(f"\nworld {report['world']}, median of {report['repeats']}, max over ranks; seconds")
    print(f"{'transition':<28}" + "".join(f"{heading:>9}" for heading in COLUMNS))
    for t in report["transitions"]:
        print(f"{t['label']:<28}" + "".join(f"{cell_text(cell, t):>9}" for cell in COLUMNS.values()))
    print("\ntargets:")
    for name, verdict in report["targets"].items():
        where = f"; missed at {', '.join(verdict['missed'])}" if verdict["missed"] else ""
        met = "met   " if verdict["met"] else "MISSED"
        print(f"  {met}  {name} ({verdict['checked']} checked{where})")


def plot(report: dict, path: str) -> None:
    """Grouped bars per transition: the live stall and each baseline, seconds on a log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = {
        "stall_s": "live reshard (stall)",
        "stall_built_at_switch_s": "live, B built at the switch",
        "stall_messages_s": "live, gloo messages",
        "baseline_gather_s": "all-gather + slice",
        "baseline_ckpt_tmpfs_s": "checkpoint via tmpfs",
        "baseline_ckpt_disk_s": "checkpoint via disk",
        "baseline_restart_s": "restart from disk",
    }
    transitions = report["transitions"]
    width = 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.5 * len(transitions)), 4.8))
    for i, (key, name) in enumerate(bars.items()):
        xs = [j + (i - (len(bars) - 1) / 2) * width for j in range(len(transitions))]
        drawn = ax.bar(xs, [t.get(key, math.nan) for t in transitions], width, label=name)
        ax.bar_label(drawn, fmt="%.2g", fontsize=6)
    ax.set_yscale("log")
    # Bars start a decade below the shortest, so that their heights compare; room above the
    # tallest for the legend.
    values = [t[key] for t in transitions for key in bars if key in t]
    ax.set_ylim(10 ** math.floor(math.log10(min(values))), 20 * max(values))
    ax.set_ylabel("seconds (median, max over ranks)")
    labels = [t["label"] for t in transitions]
    ax.set_xticks(range(len(transitions)), labels, rotation=25, ha="right")
    models = ", ".join(f"{m} {s['params'] / 1e6:.0f}M" for m, s in report["models"].items())
    ax.set_title(f"Changing the layout of {report['world']} CPU workers ({models})", fontsize=10)
    ax.legend(fontsize=8, ncol=len(bars), loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    require(__file__, {"matplotlib": "--plot" if args.plot else None})
    args.argv = sys.argv[1:] if argv is None else argv  # for the provenance record rank 0 writes
    launched = detect_launch()
    try:
        check_layouts(args, launched.world_size if launched else args.nproc)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from e
    if launched is None:
        report = launch_local(args.nproc, worker, (args,), "127.0.0.1", 0)[0]
        report["transitions"] += [
            {"chain": spec(chain), "model": chain_model(chain, args), **t}
            for chain in args.pool_transitions
            for t in run_pool_chain(chain, args)
        ]
        report["targets"] = check_targets(report["transitions"])
    else:
        report = worker(args)  # a world that torchrun made cannot grow or shrink: no pool chains
    if report is None:
        return 0
    write_outputs(args, report)
    # Speed depends on the machine; a state that differs between routes is a bug.
    return 0 if report["targets"][STATE_EQUAL]["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
