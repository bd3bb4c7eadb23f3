"""The worker pool: a job whose number of workers changes while it trains.

    python -m megatron_ext.train plugins=[reshard] launcher.nproc=4 parallel.dp=2 \
        'reshard.schedule=[{step: 50, layout: {dp: 4}}, {step: 90, layout: {dp: 1}}]'

All launched processes form the pool; the first tp·pp·dp·cp of them form megatron's world
(torch's default group), the others wait on standby. When a reshard changes that number:

1. preparing, in the background while training goes on (`prepare_resize`): each rank of the
   old world plans its own part of the move over the pool (`rank_plan`, a pure function; ranks
   past the old or new layout hold nothing there) and pool rank 0 tells the standby workers;
   every rank of the new world then builds it ahead (parallel/world.py): the torch world under a new store prefix, and in it the new layout's
   groups, model, optimizer and datasets (the ranks that stay, in a background thread:
   `LayoutController.prepare`), or a whole trainer from the job's common state (the ranks that
   join, while on standby: `LayoutController.join`);
2. at the step: pool rank 0 sends the command (new layout, its part of the move, from which a
   joining worker plans its own, the run's config and common state: counters, scheduler,
   plugin states) to every pool rank, standby ones included; the pool ranks agree that they
   planned the same move and cut their rounds (execute.py `schedule`);
3. the old world's ranks keep their model and optimizer objects as the source, release their
   layout and leave the old world; the new world's ranks enter the one built ahead (or, when it
   was not, form it now and build their layout or trainer), each layout change through the
   trainer's layout controller;
4. the state moves over the pool's own gloo group, the new layout is committed, then leaving
   ranks go back to standby.

When the job ends, pool rank 0 tells the standby ranks to exit. A pre-emption signal to a standby
worker (which is in no megatron world, so takes no part in the ranks' agreement on a stop) is
passed on through the pool's store to pool rank 0, which notes it as its own: the active ranks
stop at the next step with a checkpoint, then the standby ones exit. Failure policy: the old world's
ranks keep their model and optimizer objects untouched until the move succeeded everywhere. An
exception while building the new world ahead makes the move build it at the switch instead (every
rank drops what it built: agreed on over the pool); one while building it at the switch or
during the transfer is agreed on over the pool too; then the new world is dissolved, the old one
formed again, its ranks roll back to the old layout (`LayoutController.rollback`) and copy their
old state into it (ReshardFailed says what happened, and training goes on), and ranks that had
joined return to standby. A killed worker breaks the pool itself: the launcher restarts the job
(`launcher.max_restarts`) and it resumes from the last checkpoint. Transfers go through host
memory over gloo, on GPU too.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as Pending
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_ext.config.schema import Config, ParallelConfig
from megatron_ext.config.validate import validate_layout
from megatron_ext.platform.launch import prepare_process, rendezvous_store
from megatron_ext.platform.launch_env import LaunchEnv
from megatron_ext.platform.device import current_device
from megatron_ext.platform.dynamo_preload import preload_dynamo
from megatron_ext.platform.signals import PreemptionSignals, preemption_signals
from megatron_ext.plugin import build_plugins
from megatron_ext.reshard.execute import NOTHING_MOVED, execute, local_rounds
from megatron_ext.parallel.world import FutureWorld, leave_running_world
from megatron_ext.parallel.layout import ParallelLayout
from megatron_ext.reshard.live import Guarded, Move, Preparation, ReshardFailed, StallClock, planner_model
from megatron_ext.reshard.plan import rank_plan
from megatron_ext.reshard.state_access import MegatronState, ensure_optimizer_states
from megatron_ext.parallel.release import collection_deferred, describe, gc_paused, release_in_background
from megatron_ext.training.layout_controller import PreparedLayout
from megatron_ext.training.trainer import Trainer

# Standby workers wait for a command this long: the length of a job.
STANDBY_TIMEOUT = timedelta(days=7)
# A standby worker's pre-emption request, for pool rank 0 (the value: the worker's pool rank).
STOP_KEY = "stop_request"
# How often pool rank 0 looks for one, and a waiting standby worker for its own signals.
STOP_POLL_S = 0.1

_POOL: Optional["WorkerPool"] = None
_log = logging.getLogger(__name__)


def current_pool() -> Optional["WorkerPool"]:
    """The pool of this process (None when the job was not started as one)."""
    return _POOL


class WorkerPool:
    """This process's place in the pool: its gloo group over all workers, and the megatron
    world it is in (if any)."""

    def __init__(self, launch: LaunchEnv, device: torch.device, timeout: timedelta) -> None:
        global _POOL
        self.rank, self.size, self.device, self.timeout = launch.rank, launch.world_size, device, timeout
        self.store = rendezvous_store(launch, timeout)
        self.group = dist.ProcessGroupGloo(
            dist.PrefixStore("pool", self.store), self.rank, self.size, STANDBY_TIMEOUT
        )
        self.worlds = 0
        self._relay: Optional[threading.Thread] = None
        self._closing = threading.Event()
        _POOL = self

    # --- the megatron world --------------------------------------------------------------------

    def form_world(self, active: int) -> bool:
        """Join a new megatron world of pool ranks [0, active) if this rank is one of them."""
        number = self.next_world()
        if self.rank >= active:
            return False
        dist.init_process_group(self.backend, store=self._world_store(number), rank=self.rank, world_size=active, timeout=self.timeout)
        return True

    def future_world(self, number: int, active: int) -> FutureWorld:
        """World `number` of pool ranks [0, active), built ahead by this rank (one of them)."""
        return FutureWorld(self._world_store(number), self.rank, active, number, self.backend, self.timeout)

    def next_world(self) -> int:
        """The number of the next world (the same on every pool rank: each counts every world
        formed or prepared)."""
        self.worlds += 1
        return self.worlds

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def _world_store(self, number: int) -> dist.Store:
        return dist.PrefixStore(f"world{number}", self.store)

    # --- messages over the pool ----------------------------------------------------------------

    def broadcast(self, obj: Any = None, root: int = 0) -> Any:
        """`obj` of pool rank `root`, on every pool rank."""
        data = pickle.dumps(obj) if self.rank == root else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        self.group.broadcast(size, root).wait()
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == root else None
        if buffer is None:
            buffer = torch.empty(int(size.item()), dtype=torch.uint8)
        self.group.broadcast(buffer, root).wait()
        return pickle.loads(buffer.numpy().tobytes())

    def failures(self, error: Optional[BaseException | str]) -> dict[int, str]:
        """Every pool rank's failure (rank -> message), on every pool rank."""
        failed = torch.zeros(self.size, dtype=torch.int64)
        failed[self.rank] = int(error is not None)
        self.group.allreduce([failed]).wait()
        mine = describe(error)
        return {rank: self.broadcast(mine, rank) for rank in failed.nonzero().flatten().tolist()}

    # --- the executor's channel: the pool group (gloo: host buffers) ---------------------------

    buffer_device = torch.device("cpu")

    def exchange(self, recv: dict[int, torch.Tensor], send: dict[int, torch.Tensor], tag: int) -> list:
        """Every receive and send posted at once on the pool group."""
        works = [self.group.recv([b], peer, tag) for peer, b in recv.items()]
        return works + [self.group.send([b], peer, tag) for peer, b in send.items()]

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        self.group.allreduce([tensor]).wait()

    # --- pre-emption requests of standby workers ----------------------------------------------

    def next_command(self, signals: PreemptionSignals) -> Any:
        """On a standby worker: the next command of pool rank 0. A helper thread receives it, so
        that this (main) thread runs the signal handlers meanwhile and passes a pre-emption
        request on to pool rank 0."""
        with ThreadPoolExecutor(1, thread_name_prefix="standby") as receiver:
            command = receiver.submit(self.broadcast)
            passed_on = False
            while True:
                try:
                    return command.result(timeout=STOP_POLL_S)
                except Pending:
                    if signals.signum is not None and not passed_on:
                        self.store.set(STOP_KEY, str(self.rank))
                        passed_on = True

    def relay_stop_requests(self, signals: PreemptionSignals) -> None:
        """On pool rank 0, until `close`: note a standby worker's pre-emption request as this
        rank's own (the active ranks agree on it at the next step)."""
        self._relay = threading.Thread(target=self._relay_stop_request, args=(signals,), name="stop-relay", daemon=True)
        self._relay.start()

    def _relay_stop_request(self, signals: PreemptionSignals) -> None:
        while not self._closing.wait(STOP_POLL_S):
            if self.store.check([STOP_KEY]):
                rank = self.store.get(STOP_KEY).decode()
                signals.request(f"a request passed on by standby worker {rank}")
                return

    def close(self) -> None:
        global _POOL
        self._closing.set()
        if self._relay is not None:
            self._relay.join()
        self.group.barrier().wait()
        _POOL = None


# --- the command every pool rank carries out -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Resize:
    """Move the job to `target` (another number of active workers)."""

    cfg: Config  # the run's config, in the layout being left
    target: ParallelConfig
    common: dict  # LayoutController.common_state() of the old world
    move: Move  # pool rank 0's part of the move over the pool (the others plan their own)
    shared_memory: bool = True  # the executor's transport between processes of one host
    world: Optional[int] = None  # the number of the new world, if built ahead


@dataclasses.dataclass(frozen=True)
class PrepareWorld:
    """Build world `number` for the move to `target` ahead (pool rank 0 tells the standby
    workers while the old world trains)."""

    number: int
    cfg: Config  # the run's config, in the layout being left
    target: ParallelConfig
    common: dict  # LayoutController.common_state() when preparing began


@dataclasses.dataclass
class PreparedResize:
    """This rank's part of a move to another number of workers, prepared while training goes
    on: the plan (on pool rank 0, which sends it) and the new world built ahead, if it was
    (`number`), with what this rank built in it."""

    number: Optional[int] = None
    move: Optional[Move] = None
    world: Optional[FutureWorld] = None  # None where this rank is not in the new world
    built: Optional[PreparedLayout] = None  # a staying rank's new layout
    trainer: Any = None  # a joining rank's trainer
    error: Optional[str] = None  # building ahead failed here: what failed

    def ready(self, number: Optional[int], pool: "WorkerPool", active: int) -> bool:
        """Whether this rank holds its part of world `number` of `active` ranks."""
        mine = self.built is not None or self.trainer is not None
        return self.error is None and self.number == number and mine == (pool.rank < active)

    def discard(self) -> None:
        """Free what was built ahead (it will not be entered)."""
        release_in_background(self.world.dissolve() if self.world is not None else [])
        if self.built is not None:
            self.built.discard()
        if self.trainer is not None:
            self.trainer.layout_controller.release(in_background=True)
        self.world = self.built = self.trainer = None


def pool_layout(cfg: Config, parallel: ParallelConfig, pool_size: int) -> ParallelLayout:
    """`parallel` on the pool: its first `active` workers train, the others stand by (dp is the
    pool's share when not given)."""
    return ParallelLayout.from_config(parallel, pool_size, cfg.plugins)


def check_resize(trainer, target: ParallelConfig, pool: WorkerPool) -> None:
    """Raise ConfigError when `target` cannot run on this pool, or the trainer's plugins
    cannot train on it (before anything moves)."""
    validate_layout(dataclasses.replace(trainer.cfg, parallel=target), pool.size)


def plan_resize(trainer, target: ParallelConfig, budget_mb: float) -> Move:
    """Plan this pool rank's part of the move of `trainer`'s state to `target` over the pool."""
    start = time.perf_counter()
    pool, cfg, model = current_pool(), trainer.cfg, planner_model(trainer)
    a, b = pool_layout(cfg, cfg.parallel, pool.size), pool_layout(cfg, target, pool.size)
    transfer = rank_plan(model, a, b, pool.rank)
    return Move(target, model, transfer, int(budget_mb * 2**20), time.perf_counter() - start)


def prepare_resize(trainer, target: ParallelConfig, budget_mb: float, prebuild_target: bool = True) -> Preparation:
    """On every rank of the old world, after checking `target` here: in the background, the
    plan (on pool rank 0, the one that sends it) and, with `prebuild_target` (and no plugin
    that rewrites the model), the new world built ahead on all of its ranks."""
    pool = current_pool()
    check_resize(trainer, target, pool)
    number, message = None, None
    if prebuild_target and trainer.layout_controller.can_prepare_ahead:
        number = pool.next_world()
        message = PrepareWorld(number, trainer.cfg, target, trainer.layout_controller.common_state())
    work = functools.partial(_prepare_resize, trainer, target, budget_mb, message, current_device())
    return Preparation(target, work)


def _prepare_resize(trainer, target, budget_mb: float, message: Optional[PrepareWorld], device) -> PreparedResize:
    pool = current_pool()
    prepared, start = PreparedResize(), time.perf_counter()
    if message is not None:
        pool.broadcast(message if pool.rank == 0 else None)  # the standby workers build meanwhile
        prepared = PreparedResize(message.number)
        active = pool_layout(trainer.cfg, target, pool.size).active
        if pool.rank < active:
            prepared.world = pool.future_world(message.number, active)
            build = functools.partial(trainer.layout_controller.prepare, target, device, future_world=True)
            prepared.built, prepared.error = prepared.world.build(build)
    building_s = time.perf_counter() - start
    move = plan_resize(trainer, target, budget_mb)  # this rank's part; pool rank 0's is sent
    prepared.move = dataclasses.replace(move, seconds=move.seconds + building_s)
    return prepared


def build_ahead(pool: WorkerPool, message: PrepareWorld, plugins: list) -> PreparedResize:
    """On a standby worker: its part of world `message.number`, if it will be in it: the world
    and a trainer in it, from the job's common state (brought up to date when it joins)."""
    pool.worlds = message.number
    prepared = PreparedResize(message.number)
    active = pool_layout(message.cfg, message.target, pool.size).active
    if pool.rank < active:
        cfg = dataclasses.replace(message.cfg, parallel=message.target)
        prepared.world = pool.future_world(message.number, active)
        prepared.trainer, prepared.error = prepared.world.build(functools.partial(_joined, cfg, plugins, message.common))
    return prepared


@gc_paused()  # carry_out collects after the stall (release.py)
def resize(
    trainer,
    target: ParallelConfig,
    budget_mb: float,
    prepared: Optional[Preparation] = None,
    shared_memory: bool = True,
):
    """On the old world's ranks, at a step boundary: move the job to `target` (`prepared`: by
    `prepare_resize` on every one of them, or on none). Returns the ReshardReport; afterwards
    `trainer` is in the new world, or has `left` it."""
    clock = StallClock()
    pool = current_pool()
    check_resize(trainer, target, pool)
    mine = PreparedResize()
    if prepared is not None:
        try:
            mine = prepared.result()
        except Exception as e:  # noqa: BLE001 - the move is then built at the switch
            mine = PreparedResize(error=describe(e))
    command = None
    if pool.rank == 0:
        move = mine.move or plan_resize(trainer, target, budget_mb)
        if move.target != target:
            raise ValueError(f"reshard: prepared for {move.target}, asked for {target}")
        common = trainer.layout_controller.common_state()
        command = Resize(trainer.cfg, target, common, move, shared_memory, mine.number)
    clock.lap("prepare")
    return carry_out(pool, pool.broadcast(command), trainer, clock=clock, prepared=mine)[1]


@collection_deferred()  # a collection in the stall would hold up every rank (release.py)
def carry_out(
    pool: WorkerPool,
    command: Resize,
    trainer=None,
    plugins=(),
    clock: Optional[StallClock] = None,
    prepared: Optional[PreparedResize] = None,
):
    """Every pool rank's part of `command`. `trainer`: this rank's, if it is in the old world;
    `plugins`: for a trainer built here when this rank joins; `clock`: the stall's, if it began
    before (default: it begins now); `prepared`: this rank's part of the new world, if built
    ahead. Returns (the trainer of this rank in the new world or None, the ReshardReport). If
    building or moving failed on any rank, every rank returns to the old layout (ReshardFailed
    on the old world's ranks; a rank that had joined returns (None, None) and goes back to
    standby)."""
    clock = clock or StallClock()
    mine = prepared.move if prepared is not None and prepared.move is not None else command.move
    move = (mine if mine.target == command.target else command.move).for_rank(pool.rank)
    move = move.scheduled(channel=pool)  # every pool rank planned the same move, or none moves
    prepared = _agree_on_prepared(pool, command, prepared)
    clock.lap("agree")
    old, source = trainer, None
    if old is not None:  # its model and optimizer objects are only read from now on
        ensure_optimizer_states(old.optimizer)
        source = MegatronState(old.model, old.optimizer)
        old.layout_controller.release(in_background=True)
        release_in_background(leave_running_world())
    clock.lap("leave")
    new, error = None, None
    if _enter_world(pool, move.transfer.b.active, prepared):
        try:
            new = _enter(command, old, plugins, prepared)
        except Exception as e:  # noqa: BLE001 - agreed on by every pool rank, then rolled back
            error = e
    failures = pool.failures(error)
    clock.lap("switch")
    executed = NOTHING_MOVED
    if not failures:
        target = MegatronState(new.model, new.optimizer) if new is not None else None
        guarded = Guarded(source.read if source else _holds_nothing, target.write if target else _holds_nothing)
        executed = execute(
            move.transfer,
            move.steps,
            guarded.read,
            guarded.write,
            channel=pool,
            shared_memory=command.shared_memory and move.network_bytes > 0,  # the same on every rank
        )
        failures = pool.failures(guarded.error)
        clock.lap("transfer")
    if failures:
        return _roll_back(pool, command, old, new, source, failures)
    if new is not None:
        new.layout_controller.commit()
    release_in_background(source)  # the left layout's model and optimizer
    del source
    pool.group.barrier().wait()
    return new, move.report(executed, clock, built_ahead=prepared is not None)


def _agree_on_prepared(pool: WorkerPool, command: Resize, prepared: Optional[PreparedResize]):
    """`prepared`, if every pool rank holds its part of the world `command` was prepared with;
    otherwise None, and every rank drops what it built (the move builds at the switch)."""
    if command.world is not None:
        active = command.move.transfer.b.active
        ready = prepared is not None and prepared.ready(command.world, pool, active)
        failures = pool.failures(None if ready else _not_ready(prepared))
        if not failures:
            return prepared
        _log.warning("reshard: building the new world ahead failed (%s); building it at the switch", failures)
    if prepared is not None:
        prepared.discard()
    return None


def _not_ready(prepared: Optional[PreparedResize]) -> str:
    if prepared is not None and prepared.error is not None:
        return prepared.error
    return "this rank did not build its part of the new world"


def _enter_world(pool: WorkerPool, active: int, prepared: Optional[PreparedResize]) -> bool:
    """Enter the new world (the one built ahead, or a new one formed now) if this rank is in
    it."""
    if prepared is None:
        return pool.form_world(active)
    if prepared.world is None:
        return False
    prepared.world.enter()
    return True


def _enter(command: Resize, old, plugins, prepared: Optional[PreparedResize]):
    """This rank's trainer in the new world: `old` switched to the new layout, or one that
    joins (built ahead, or now, from the job's common state); its weights and states are
    placeholders until the move."""
    if old is not None:
        old.layout_controller.install(prepared.built if prepared else command.move.transfer.b)
        trainer = old
    elif prepared is not None:
        trainer = prepared.trainer
        trainer.layout_controller.catch_up(command.common)
    else:
        trainer = _joined(dataclasses.replace(command.cfg, parallel=command.target), plugins, command.common)
    ensure_optimizer_states(trainer.optimizer)
    return trainer


def _joined(cfg: Config, plugins, common: dict):
    """A trainer of layout `cfg` for a rank that joins a job in `common` state."""
    trainer = Trainer(cfg, list(plugins))
    try:
        trainer.layout_controller.join(common)
    except Exception:
        trainer.layout_controller.release()  # megatron's state of the half-built layout: this rank may join again
        raise
    return trainer


def _roll_back(pool: WorkerPool, command: Resize, old, new, source, failures: dict[int, str]):
    """Every pool rank back to the old world: the old world's ranks roll back to the old layout
    and copy their untouched old state into it, then raise ReshardFailed; others go to standby."""
    what = "; ".join(f"rank {rank}: {message}" for rank, message in sorted(failures.items()))
    if new is not None:
        new.layout_controller.release()
    if dist.is_initialized():  # this rank was in the new world
        dist.destroy_process_group()
    a = command.move.transfer.a
    if not pool.form_world(a.active):
        return None, None
    old.layout_controller.rollback()
    ensure_optimizer_states(old.optimizer)
    stay = rank_plan(planner_model(old), a, a, pool.rank)  # local copies only: every rank holds its part
    write = MegatronState(old.model, old.optimizer).write
    # Only the old world's ranks take part: no shared memory, whose set-up is collective.
    execute(stay, local_rounds(stay), source.read, write, channel=pool, shared_memory=False)
    raise ReshardFailed(f"reshard failed ({what}); rolled back to {a}, no state lost")


def _holds_nothing(*args) -> None:
    raise AssertionError("reshard: the plan reads or writes state on a rank that holds none")


def pooled_worker(cfg: Config, timeout_s: int = 600) -> dict:
    """One process of a pooled job: train while in the megatron world, wait on standby while
    not. Returns the run summary (complete on pool rank 0, which is in every world)."""
    pool = WorkerPool(*prepare_process(cfg.launcher.device), timedelta(seconds=timeout_s))
    with preemption_signals() as signals:  # the rank's, from its start (train.worker)
        summary = _serve(pool, cfg, signals)
    pool.close()
    return summary


def _serve(pool: WorkerPool, cfg: Config, signals: PreemptionSignals) -> dict:
    """Train while in the megatron world, wait on standby while not, until the job is over."""
    if pool.rank == 0:
        pool.relay_stop_requests(signals)
    trainer, summary, prepared = None, {}, None
    if pool.form_world(pool_layout(cfg, cfg.parallel, pool.size).active):
        trainer = Trainer(cfg, build_plugins(cfg.plugins, cfg))
        trainer.setup()
    else:  # on standby: the first optimizer built imports TorchDynamo (about 1 s), not in the stall
        preload_dynamo()
    while True:
        if trainer is None:  # standby
            with gc_paused():  # a Resize command starts the stall
                command = pool.next_command(signals)
            if prepared is not None and not isinstance(command, Resize):
                prepared.discard()  # superseded by another, or the job is over
            if command is None:
                break  # the job is over
            plugins = build_plugins(command.cfg.plugins, command.cfg)
            if isinstance(command, PrepareWorld):
                prepared = build_ahead(pool, command, plugins)
            else:
                trainer, _ = carry_out(pool, command, plugins=plugins, prepared=prepared)
                prepared = None
            continue
        summary = trainer.train()
        if trainer.layout is None:  # left the job's world: standby
            trainer = None
            continue
        trainer.close()
        dist.destroy_process_group()
        pool.broadcast(None)  # from pool rank 0: standby workers exit
        break
    return summary
