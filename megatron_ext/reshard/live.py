"""Reshard a running trainer to another layout of the same workers, between two steps.

    report = reshard(trainer, ParallelConfig(pp=2, dp=2), budget_mb=64)

    prepared = prepare(trainer, ParallelConfig(pp=2, dp=2), budget_mb=64)  # plans in a thread
    ...                                                 # training goes on meanwhile
    report = reshard(trainer, prepared.target, prepared=prepared)

`trainer` is a Trainer or, from a plugin's `on_step_begin`, the PluginContext it receives: this
module and pool.py use only the context's members of it, and change the layout through its
`layout_controller` (megatron_ext/training/layout_controller.py).

1. Check the new layout against the model (the runtime's rules) before anything changes.
2. Prepare: plan this rank's part of the move (`rank_plan`: pure, from the layouts alone); then
   build the new layout's process groups, model, DDP and optimizer beside the
   running one (`LayoutController.prepare`). `prepare` runs both in a background thread while
   the current layout keeps training.
3. The stall: agree (one small all-reduce: every rank planned the same move with the same
   budget, and the byte counts from which each rank cuts its own memory-budgeted rounds;
   execute.py `schedule`), keep the old model and optimizer objects, switch to the new layout
   (`LayoutController.install`: the layout prepared, or built now; scheduler, counters
   and data position carried), and move every param, fp32 main param, Adam moment and the step
   from the old objects into the new ones with the point-to-point executor; then drop the old
   ones and commit the new layout.

Never losing state: the old objects are only read until every rank reports success. Every rank
reports after the build and after the transfer (one small all-gather each). A local failure
(an exception while building or while reading or writing a piece) does not leave peers waiting:
the failing rank keeps sending what the plan says (zeros in place of what it could not read), so
every round completes. If any rank failed, all ranks roll back to the old layout
(`LayoutController.rollback`) and fill it from the untouched old objects (a plan with local
copies only), and `ReshardFailed` says what happened.
A worker that dies mid-transfer breaks the world itself: the others get a communication error,
the launcher restarts the job (`launcher.max_restarts`) and it resumes from the last checkpoint.

RNG policy: the default (data-parallel) generator and the model-parallel streams are re-seeded
from `train.seed` by the new layout, as at start-up; megatron_ext's models have no dropout, so
no result depends on them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_ext.config.schema import ModelConfig, ParallelConfig
from megatron_ext.config.validate import validate_layout
from megatron_ext.platform.device import current_device
from megatron_ext.reshard.boxes import Box
from megatron_ext.reshard.execute import NOTHING_MOVED, Executed, Round, execute, local_rounds, schedule
from megatron_ext.parallel.layout import ParallelLayout
from megatron_ext.reshard.plan import RankPlan, rank_plan
from megatron_ext.reshard.state_access import MegatronState, ensure_optimizer_states
from megatron_ext.reshard.vps import Piece
from megatron_ext.parallel.release import collection_deferred, describe, release_in_background
from megatron_ext.training.layout_controller import PreparedLayout


_log = logging.getLogger(__name__)


class ReshardFailed(RuntimeError):
    """A reshard failed on some rank and every rank is back in the old layout, state intact."""


@dataclasses.dataclass(frozen=True)
class ReshardReport:
    source: str
    target: str
    network_bytes: int  # summed over ranks: the minimum (see plan.py)
    rounds: int
    peak_bound_bytes: int  # the largest staging any rank may need, from the rounds
    peak_extra_bytes: int  # the staging this rank held at most, measured
    transport: str  # how the state travelled: "shared memory" or "messages" (execute.py)
    prepare_seconds: float  # plan and rounds: before the stall, in the background if prepared
    stall_seconds: float  # build the new layout and move the state: training stands still
    built_ahead: bool  # the new layout was built before the stall (prebuilt), not in it
    # Where this rank's stall went, in order (StallClock's parts; they sum to stall_seconds).
    stall_parts: dict[str, float] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        parts = ", ".join(f"{name} {seconds:.2f}" for name, seconds in self.stall_parts.items())
        return (
            f"reshard {self.source} -> {self.target}: {self.network_bytes / 2**20:.1f} MiB over the "
            f"network in {self.rounds} rounds through {self.transport} (staging peak "
            f"{self.peak_bound_bytes / 2**20:.1f} MiB), "
            f"prepare {self.prepare_seconds:.2f} s, stall {self.stall_seconds:.2f} s "
            f"({'built ahead' if self.built_ahead else 'built at the switch'}; {parts})"
        )


class StallClock:
    """Where a stall's seconds go: `lap(name)` ends the part `name`, which lasted since the
    previous lap (or since the clock started)."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self.parts: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.parts[name] = self.parts.get(name, 0.0) + now - self._last
        self._last = now


@dataclasses.dataclass(frozen=True)
class Move:
    """A planned move of the trainer's state to `target`."""

    target: ParallelConfig
    model: ModelConfig  # the planner's (the run's padded vocabulary)
    transfer: RankPlan  # this rank's part
    budget_bytes: int
    seconds: float  # planning (and building ahead) time
    prebuilt: Optional[PreparedLayout] = None  # the target layout, built beside the running one
    build_failure: Optional[str] = None  # why building it beside the running one failed here
    steps: list[Round] = dataclasses.field(default_factory=list)  # this rank's rounds, once agreed
    peak_bound: int = 0  # the largest staging any rank may need in them
    network_bytes: int = 0  # every rank's received bytes, summed

    def for_rank(self, rank: int) -> "Move":
        """The same move planned for `rank` (a worker that joins plans its own part)."""
        if rank == self.transfer.rank:
            return self
        start = time.perf_counter()
        transfer = rank_plan(self.model, self.transfer.a, self.transfer.b, rank)
        return Move(self.target, self.model, transfer, self.budget_bytes, time.perf_counter() - start)

    def scheduled(self, channel=None) -> "Move":
        """This move with its rounds, after checking that every rank of `channel` (default:
        the world) planned the very same move with the same budget: ValueError on every rank
        otherwise, before anything changes."""
        agreed = schedule(self.transfer, self.budget_bytes, channel)
        return dataclasses.replace(
            self, steps=agreed.steps, peak_bound=agreed.peak_bound, network_bytes=agreed.network_bytes
        )

    def discard(self) -> None:
        """Free what was built for this move (it will not be carried out)."""
        if self.prebuilt is not None:
            self.prebuilt.discard()

    def report(self, executed: Executed, clock: StallClock, built_ahead: Optional[bool] = None) -> ReshardReport:
        """The report of this move once carried out, its stall ending now (`built_ahead`:
        default, whether a layout was prebuilt for it)."""
        clock.lap("finish")
        return ReshardReport(
            source=str(self.transfer.a),
            target=str(self.transfer.b),
            network_bytes=self.network_bytes,
            rounds=len(self.steps),
            peak_bound_bytes=self.peak_bound,
            peak_extra_bytes=executed.staged_bytes,
            transport=executed.transport,
            prepare_seconds=self.seconds,
            stall_seconds=sum(clock.parts.values()),
            built_ahead=self.prebuilt is not None if built_ahead is None else built_ahead,
            stall_parts=dict(clock.parts),
        )


def plan_move(trainer, target: ParallelConfig, budget_mb: float) -> Move:
    """Check `target` and plan this rank's part of the move to it. Raises ValueError (a
    ConfigError for a layout the model cannot run) before anything changes; a budget below one
    element per peer is refused when the ranks agree (`Move.scheduled`), also before."""
    start = time.perf_counter()
    model, a, b = _layouts(trainer, target)
    transfer = rank_plan(model, a, b, dist.get_rank())
    return Move(target, model, transfer, int(budget_mb * 2**20), time.perf_counter() - start)


# Every background preparation runs on this one thread, in the order asked: building a layout
# creates process groups, which every rank must do in the same order.
_BACKGROUND = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reshard-prepare")


class Preparation:
    """A move prepared in the background, so that the current layout keeps training meanwhile.
    Check the target first, in the caller's thread (`prepare` does)."""

    def __init__(self, target: ParallelConfig, planner: Callable[[], Move]) -> None:
        self.target = target
        self._future: Future = _BACKGROUND.submit(planner)

    def done(self) -> bool:
        return self._future.done()

    def result(self):
        """What was prepared (waits for it): a Move, or the worker pool's PreparedResize;
        re-raises what preparing raised."""
        return self._future.result()

    def discard(self) -> None:
        """Give up this move: wait for its preparation, then free what it built."""
        try:
            prepared = self._future.result()
        except Exception:  # noqa: BLE001 - nothing was kept
            return
        prepared.discard()


def prepare(trainer, target: ParallelConfig, budget_mb: float, prebuild_target: bool = True) -> Preparation:
    """`plan_move` in the background, after checking `target` here; then, with
    `prebuild_target` (and no plugin that rewrites the model), the target layout is built there
    too, so that the stall is only the switch and the transfer."""
    _layouts(trainer, target)
    planner = functools.partial(plan_move, trainer, target, budget_mb)
    if prebuild_target and trainer.layout_controller.can_prepare_ahead:
        planner = functools.partial(_plan_and_build, trainer, planner, current_device())
    return Preparation(target, planner)


def _plan_and_build(trainer, planner: Callable[[], Move], device: torch.device) -> Move:
    move = planner()
    start = time.perf_counter()
    built, failure = trainer.layout_controller.prepare_or_failure(move.target, device)
    seconds = move.seconds + time.perf_counter() - start
    return dataclasses.replace(move, prebuilt=built, build_failure=failure, seconds=seconds)


@collection_deferred()  # a collection in the stall would hold up every rank (release.py)
def reshard(
    trainer,
    target: ParallelConfig,
    budget_mb: float = 64.0,
    prepared: Optional[Preparation] = None,
    shared_memory: bool = True,
) -> ReshardReport:
    """Move `trainer` (at a step boundary) to the layout `target` of the same world (the state
    through shared memory where every rank can, with `shared_memory`; see execute.py). The
    stall starts here: waiting for `prepared`, if it is not done yet, is part of it."""
    clock = StallClock()
    move = prepared.result() if prepared is not None else plan_move(trainer, target, budget_mb)
    clock.lap("prepare")
    if move.target != target:
        raise ValueError(f"reshard: prepared for {move.target}, asked for {target}")
    move = _agree(move)
    clock.lap("agree")
    source_parallel = trainer.cfg.parallel
    ensure_optimizer_states(trainer.optimizer)  # a job that has not stepped yet has none
    source = MegatronState(trainer.model, trainer.optimizer)
    entered = move.prebuilt if move.prebuilt is not None else move.transfer.b  # built now without one
    install = functools.partial(trainer.layout_controller.install, entered)
    errors, executed = _switch_and_move(trainer, install, move, source, shared_memory, clock)
    if errors:
        _roll_back(trainer, source_parallel, source, errors)
    trainer.layout_controller.commit()
    release_in_background(source)  # the left layout: its groups' destructors take tens of ms each
    del source
    return move.report(executed, clock)


def _agree(move: Move) -> Move:
    """`move` with its rounds, after checking that every rank planned the very same move (each
    rank plans its own part; the digest of the inputs, the planner and the budget: refused
    before anything changes otherwise), and whether building its layout ahead failed anywhere:
    then every rank drops what it built, the log says why, and the same move builds at the
    switch."""
    try:
        move = move.scheduled()
    except ValueError:
        move.discard()
        raise
    failed = torch.tensor([int(move.build_failure is not None)])
    dist.all_reduce(failed)
    if not failed.item():
        return move
    failures = _gather_errors(move.build_failure)
    _log.warning("reshard: building %s ahead failed (%s); building it at the switch", move.transfer.b, failures)
    move.discard()
    return dataclasses.replace(move, prebuilt=None, build_failure=None)


def _layouts(trainer, target: ParallelConfig) -> tuple[ModelConfig, ParallelLayout, ParallelLayout]:
    """(the planner's model, the layout now, the layout `target`), after checking `target`."""
    validate_layout(dataclasses.replace(trainer.cfg, parallel=target), dist.get_world_size())
    return planner_model(trainer), _layout(trainer.cfg.parallel), _layout(target)


def planner_model(trainer) -> ModelConfig:
    # The planner sees the run's padded vocabulary, which stays fixed for the run.
    return dataclasses.replace(trainer.cfg.model, vocab_size=trainer.vocab_size)


def _layout(parallel: ParallelConfig) -> ParallelLayout:
    return ParallelLayout.from_config(parallel, dist.get_world_size())


def _switch_and_move(
    trainer,
    enter: Callable[[], None],
    move: Move,
    source: MegatronState,
    shared_memory: bool = False,
    clock: Optional[StallClock] = None,
) -> tuple[dict[int, str], Executed]:
    """Enter `move.target` (`enter`: through the trainer's layout controller) and fill it from
    `source`. Returns (failures by rank, the transfer); every rank returns the same failures."""
    clock = clock or StallClock()
    try:
        enter()
        ensure_optimizer_states(trainer.optimizer)
        error = None
    except Exception as e:  # noqa: BLE001 - reported to every rank, then rolled back
        error = e
    errors = _gather_errors(error)
    clock.lap("switch")
    if errors:
        move.discard()
        return errors, NOTHING_MOVED
    guarded = Guarded(source.read, MegatronState(trainer.model, trainer.optimizer).write)
    shared_memory = shared_memory and move.network_bytes > 0  # the same on every rank
    executed = execute(move.transfer, move.steps, guarded.read, guarded.write, shared_memory=shared_memory)
    errors = _gather_errors(guarded.error)
    clock.lap("transfer")
    return errors, executed


def _roll_back(trainer, parallel: ParallelConfig, source: MegatronState, errors: dict[int, str]) -> None:
    """Back to layout `parallel` (the one committed last) from the untouched old objects, then
    raise ReshardFailed."""
    what = "; ".join(f"rank {rank}: {message}" for rank, message in sorted(errors.items()))
    a, model = _layout(parallel), planner_model(trainer)
    stay = rank_plan(model, a, a, dist.get_rank())  # local copies only: every rank holds its part
    back = Move(parallel, model, stay, 0, 0.0, steps=local_rounds(stay))
    again, _ = _switch_and_move(trainer, trainer.layout_controller.rollback, back, source)
    if again:
        raise RuntimeError(
            f"reshard: moving back to {a} failed too ({again}) after: {what}; restart from the "
            "last checkpoint"
        )
    raise ReshardFailed(f"reshard failed ({what}); rolled back to {a}, no state lost")


def _gather_errors(error: Optional[BaseException | str]) -> dict[int, str]:
    """Every rank's failure (rank -> message), on every rank."""
    failed = torch.tensor([int(error is not None)])
    dist.all_reduce(failed)  # the common case in one small tensor; the messages only on failure
    if not failed.item():
        return {}
    mine = describe(error)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {rank: message for rank, message in enumerate(everyone) if message is not None}


class Guarded:
    """read/write functions for the executor that record the first exception instead of
    raising it, so that this rank still sends and receives what the plan says and no peer
    waits for a message that never comes. What could not be read is sent as zeros; the
    transfer's result is then thrown away by the rollback."""

    def __init__(self, read: Callable[[Piece, Box], torch.Tensor], write: Callable) -> None:
        self._read, self._write = read, write
        self.error: Optional[BaseException] = None

    def read(self, piece: Piece, box: Box) -> torch.Tensor:
        if self.error is None:
            try:
                return self._read(piece, box)
            except Exception as e:  # noqa: BLE001
                self.error = e
        return torch.zeros(())

    def write(self, piece: Piece, box: Box, values: torch.Tensor) -> None:
        if self.error is None:
            try:
                self._write(piece, box, values)
            except Exception as e:  # noqa: BLE001
                self.error = e
