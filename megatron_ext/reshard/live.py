"""Reshard a running trainer to another layout of the same workers, between two steps.

    report = reshard(trainer, ParallelConfig(pp=2, dp=2), budget_mb=64)

1. Check the new layout against the model (the runtime's rules) before anything changes.
2. Plan the move (pure, identical on every rank) and cut it into memory-budgeted rounds.
3. Keep the old model and optimizer objects, build the new layout (`Trainer.switch_layout`:
   groups, model, DDP, optimizer; scheduler, counters and data position carried).
4. Move every param, fp32 main param, Adam moment and the step from the old objects into the
   new ones with the point-to-point executor; then drop the old ones.

RNG policy: the default (data-parallel) generator and the model-parallel streams are re-seeded
from `train.seed` by the new layout, as at start-up; megatron_ext's models have no dropout, so
no result depends on them.
"""

from __future__ import annotations

import dataclasses
import time

import torch.distributed as dist

from megatron_ext.config.schema import ParallelConfig
from megatron_ext.config.validate import validate
from megatron_ext.reshard.execute import execute, peak_bytes, rounds
from megatron_ext.reshard.layout import ParallelLayout
from megatron_ext.reshard.plan import plan
from megatron_ext.reshard.state_access import MegatronState, ensure_optimizer_states


@dataclasses.dataclass(frozen=True)
class ReshardReport:
    source: str
    target: str
    network_bytes: int  # the plan's, summed over ranks: the minimum (see plan.py)
    rounds: int
    peak_bound_bytes: int  # the largest staging any rank may need, from the plan
    peak_extra_bytes: int  # the staging this rank held at most, measured
    prepare_seconds: float  # plan and rounds (and, later, groups): before the stall
    stall_seconds: float  # build the new layout and move the state: training stands still

    def __str__(self) -> str:
        return (
            f"reshard {self.source} -> {self.target}: {self.network_bytes / 2**20:.1f} MiB over the "
            f"network in {self.rounds} rounds (staging peak {self.peak_bound_bytes / 2**20:.1f} MiB), "
            f"prepare {self.prepare_seconds:.2f} s, stall {self.stall_seconds:.2f} s"
        )


def reshard(trainer, target: ParallelConfig, budget_mb: float = 64.0) -> ReshardReport:
    """Move `trainer` (at a step boundary) to the layout `target` of the same world."""
    world = dist.get_world_size()
    validate(dataclasses.replace(trainer.cfg, parallel=target), world)
    # The planner sees the run's padded vocabulary, which stays fixed for the run.
    model = dataclasses.replace(trainer.cfg.model, vocab_size=trainer.vocab_size)
    a = ParallelLayout.from_config(trainer.cfg.parallel, world)
    b = ParallelLayout.from_config(target, world)

    start = time.perf_counter()
    transfer = plan(model, a, b)
    steps = rounds(transfer, int(budget_mb * 2**20))
    planned = time.perf_counter()

    ensure_optimizer_states(trainer.optimizer)  # a job that has not stepped yet has none
    source = MegatronState(trainer.model, trainer.optimizer)
    trainer.switch_layout(target)
    ensure_optimizer_states(trainer.optimizer)
    staged = execute(transfer, steps, source.read, MegatronState(trainer.model, trainer.optimizer).write)
    dist.barrier()
    return ReshardReport(
        source=str(a),
        target=str(b),
        network_bytes=transfer.network_bytes,
        rounds=len(steps),
        peak_bound_bytes=max(peak_bytes(transfer, steps).values(), default=0),
        peak_extra_bytes=staged,
        prepare_seconds=planned - start,
        stall_seconds=time.perf_counter() - planned,
    )
