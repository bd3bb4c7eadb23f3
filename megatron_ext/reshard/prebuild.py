"""Build the destination layout while the current one keeps training.

Megatron keeps its parallel state (every process group, rank list and cached size) in the
globals of `megatron.core.parallel_state`, and the running layout reads them at every step. The
destination's state is made in a private copy of that module instead: its own
`initialize_model_parallel` creates the destination's process groups (collective over the world,
in the same order on every rank: here in each rank's background thread) and leaves the running
layout's globals alone. The model, DDP and optimizer are then built on those groups, passed
explicitly (megatron's `pg_collection`), with memory allocated and values left as they are: the
transfer fills every one of them. The one collective of megatron's builders over the default
group (the optimizer factory agreeing on param groups) goes over a private copy of the world
group instead, so that it cannot pair up with the running layout's collectives.

At the switch, `Prebuilt.install` copies the private module's state into megatron's, which costs
a few dictionary writes; what is left of the stall is the transfer.

Memory: the destination is allocated from the moment the build finishes, while the source keeps
training, instead of from the switch on. Both live together during the transfer either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_ext.config.schema import ParallelConfig
from megatron_ext.platform.megatron_parallel_state import created_groups, install, private_parallel_state, process_groups
from megatron_ext.platform.torch_worlds import live_groups, thread_gathers_over
from megatron_ext.config.capabilities import Capability
from megatron_ext.reshard.state_access import ensure_optimizer_states
from megatron_ext.parallel.release import built_or_failure, release_in_background, unlink_optimizer
from megatron_ext.parallel.groups import destroy_groups, parallel_state_sizes
from megatron_ext.parallel.layout import ParallelLayout

# What a plugin whose hooks rewrite each model built declares (each overridden hook implies its own).
_REWRITES_MODEL = frozenset({Capability.REWRITES_LAYER_SPECS, Capability.EDITS_BUILT_MODEL})


@dataclasses.dataclass
class Prebuilt:
    """A layout built beside the running one: megatron's state for it (in a private module,
    its process groups included), and the trainer's model chunks, megatron config and
    optimizer."""

    state: types.ModuleType
    model: list
    model_config: Any  # megatron's TransformerConfig
    optimizer: Any
    datasets: Optional[tuple] = None  # (training, validation), opened in a world not yet entered
    installed: bool = False

    def install(self) -> None:
        """Make this layout megatron's current one. Call after the running layout was left
        (megatron's state is empty then)."""
        release_in_background(install(self.state))
        self.installed = True

    def discard(self) -> None:
        """Free a layout that will not be installed: its groups, and (once unreferenced) its
        model and optimizer."""
        if self.installed:
            return  # megatron's now: leaving it is the trainer's business
        unlink_optimizer(self.model_config)
        destroy_groups(created_groups(self.state))
        self.model = self.optimizer = None


def initialize(parallel: ParallelConfig) -> types.ModuleType:
    """`parallel`'s megatron state, process groups included, in a private module. Collective:
    every rank of the world calls it, in the same order relative to other group creations."""
    state = private_parallel_state()
    state.initialize_model_parallel(**parallel_state_sizes(parallel))
    return state


def prebuild(trainer, parallel: ParallelConfig, device: torch.device, future_world: bool = False) -> Prebuilt:
    """`parallel`'s groups, model, DDP and optimizer on `device` (the rank's: a thread's current
    CUDA device is its own), built without touching the running layout. Safe in a background
    thread of every rank while the main thread trains: the running layout's groups are not
    used, and the new ones are created in the same order everywhere. `future_world`: this
    thread builds in a torch world not yet entered (parallel/world.py), whose default group only
    the building threads use; the datasets are opened there too (collective, as for the ranks
    that join it)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    state = initialize(parallel)
    with contextlib.nullcontext() if future_world else _own_world_group():
        groups = process_groups(state)
        model, config = trainer.build_model(parallel, groups=groups, initialise=False)
        optimizer = trainer.build_optimizer(model, config, parallel, groups=groups)
    ensure_optimizer_states(optimizer)
    _fault_in(model, optimizer)
    datasets = None
    if future_world:
        datasets = trainer.open_datasets(ParallelLayout.from_config(parallel, dist.get_world_size()).dp)
    return Prebuilt(state, model, config, optimizer, datasets)


def prebuild_or_failure(trainer, parallel: ParallelConfig, device: torch.device) -> tuple[Optional[Prebuilt], Optional[str]]:
    """(`prebuild(...)`, None) in the running world, or (None, what failed), the failed build's
    process groups destroyed at once (`built_or_failure`): the other ranks' collectives in them
    fail too rather than wait for this rank until the timeout."""
    before = set(live_groups())

    def destroy_new_groups() -> None:
        destroy_groups([g for g in live_groups() if g not in before])

    return built_or_failure(lambda: prebuild(trainer, parallel, device), destroy_new_groups)


@contextlib.contextmanager
def _own_world_group() -> Iterator[None]:
    """Within the block, this thread's `all_gather_object` calls without a group go over a
    private copy of the world group. Megatron's optimizer factory agrees on its param groups by
    an `all_gather_object` over the default group, which the running layout uses in the main
    thread meanwhile; two threads' collectives on one group may pair up differently on each
    rank. Other threads keep calling torch's function unchanged.

    Entering it ends the build's group creation on every rank: a rank whose build fails later
    destroys its groups, and a peer still connecting one of them (torch does not wait for all
    ranks at `new_group`) would retry the connection until the group timeout."""
    world = dist.new_group(list(range(dist.get_world_size())))  # collective: in the same order
    dist.barrier(group=world)
    try:
        with thread_gathers_over(world):
            yield
    finally:
        dist.destroy_process_group(world)


def _fault_in(model: list, optimizer) -> None:
    """Write every tensor of the new layout once, here in the background. Host memory is mapped
    on first write: left for the transfer, the page faults doubled its time (100M model, CPU).
    The values are placeholders, which the transfer overwrites."""
    tensors = [p for chunk in model for p in chunk.parameters()]
    tensors += [b.grad_data for chunk in model for b in chunk.buffers + chunk.expert_parallel_buffers]
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        tensors += [p for group in opt.optimizer.param_groups for p in group["params"]]
        tensors += [v for state in opt.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    with torch.no_grad():
        for tensor in tensors:
            tensor.zero_()


def can_prebuild(trainer) -> bool:
    """Whether the destination may be built in the background. Plugins that rewrite the model
    (`layer_spec`, `after_model_built`) may read megatron's global state, which still describes
    the running layout until the switch; with them the destination is built at the switch."""
    return not any(p.capabilities & _REWRITES_MODEL for p in trainer.plugins)
