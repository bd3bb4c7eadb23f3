"""The reshard plugin's config section (`reshard.*`) and its checks before launch; no torch.

A layout names the sizes that change (`SIZES`); the others keep the run's values, and dp is
derived when left out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_ext.config.batch_sizes import schedule_key
from megatron_ext.config.capabilities import Capability
from megatron_ext.config.plugin_sections import PluginSection
from megatron_ext.config.schema import Config, ParallelConfig
from megatron_ext.config.validate import ConfigError, validate_layout

# The sizes a layout may name.
SIZES = ("tp", "pp", "dp", "ep", "cp", "vpp")


@dataclass
class ReshardConfig:
    # [{step: N, layout: {tp: .., pp: .., dp: .., ep: .., cp: .., vpp: ..}}, ...]: reshard
    # before step N runs.
    schedule: list[Any] = field(default_factory=list)
    # A JSON file {"layout": {...}} polled between steps (None: no polling).
    request_file: Optional[str] = None
    # Staging memory per rank per transfer round, for what a rank sends and, separately, for
    # what it receives: the staging peak is at most twice this (printed in the reshard line).
    memory_budget_mb: float = 64.0
    # Rank 0 appends one JSON line per move here (its ReshardReport and the step); None: none.
    report_file: Optional[str] = None
    # Build the new layout (groups, model, optimizer; for another number of workers the new
    # torch world and the joining workers' trainers too) in the background before the switch.
    # It then holds its memory from the end of preparing on, beside the running layout's.
    prebuild: bool = True
    # Start preparing a scheduled move this many steps before it.
    prepare_steps_ahead: int = 20
    # Between the processes of one host, move the state through shared memory (/dev/shm)
    # rather than as gloo messages; falls back to messages by itself where it cannot.
    shared_memory: bool = True


def target_config(current: ParallelConfig, layout: dict) -> ParallelConfig:
    """The run's ParallelConfig with the sizes `layout` names changed."""
    unknown = set(layout) - set(SIZES)
    if unknown:
        raise ValueError(f"reshard layout: unknown size(s) {sorted(unknown)}; use {list(SIZES)}")
    changes = dict(layout)
    changes.setdefault("dp", None)  # derived from the world unless named
    return dataclasses.replace(current, **changes)


def check(own: ReshardConfig, cfg: Config, world_size: int) -> None:
    """Settings or a scheduled layout that cannot work are a config error: refuse them before
    launching."""
    if schedule_key(cfg.train):  # moves, prebuilt layouts and joining workers are not made to follow one
        raise ConfigError(schedule_key(cfg.train), "reshard moves runs of one global batch; a batch-size schedule "
                                                   "is not supported with it: use a fixed train.global_batch_size")
    if own.memory_budget_mb <= 0:
        raise ConfigError("reshard.memory_budget_mb", f"must be positive, got {own.memory_budget_mb}")
    if own.prepare_steps_ahead < 0:
        raise ConfigError("reshard.prepare_steps_ahead", f"must be 0 or more, got {own.prepare_steps_ahead}")
    check_schedule(cfg, own.schedule, world_size)


def check_schedule(cfg: Config, schedule: list, world_size: int) -> None:
    """Raise ConfigError for the first scheduled layout the model, or one of the run's plugins,
    cannot run on `world_size` workers, each layout taken from the one before it."""
    parallel = cfg.parallel
    for entry in sorted(schedule, key=lambda e: int(e["step"])):
        parallel = target_config(parallel, dict(entry["layout"]))
        validate_layout(dataclasses.replace(cfg, parallel=parallel), world_size)


# The job is a worker pool (its runner) launched with as many workers as its largest layout
# needs: a layout may use fewer.
SECTION = PluginSection("reshard", ReshardConfig, check=check, capabilities=frozenset({
    Capability.CHANGES_LAYOUT, Capability.STANDBY_WORKERS, Capability.OWNS_RUN}))
