"""The process groups a plan's packs train in, so that packs on separate devices run at once.

A plan's device is one TP block of the world: ranks [d * tp, (d + 1) * tp), which is exactly a
tensor-parallel group of megatron's parallel state at that tp (consecutive ranks), so the base
model and the adapters use megatron's TP groups unchanged. What differs per pack is the rest:
  - `group`: every rank of the pack (the runtime's "did any rank fail" votes),
  - `dp_group`: the ranks of the pack at this rank's TP position (the adapter gradient sums).
Every rank runs the packs it belongs to in plan order. A pack's ranks have all finished every
earlier pack they share a device with, so the earliest unfinished pack always has all its ranks
and the order cannot deadlock.

Megatron's dist_checkpointing (0.16) has no process-group argument: its saves and loads are
collective over torch.distributed's default group. `as_world(group)` makes a pack's group this
process's default group for the length of one save or load, so that a pack checkpoints over its
own ranks while other packs train on theirs.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch.distributed as dist
from torch.distributed import distributed_c10d

from megatron_ext.lora.plan import Plan


@dataclass(frozen=True)
class PackGroups:
    ranks: tuple[int, ...]  # every rank of the pack, ascending
    group: dist.ProcessGroup
    dp_group: dist.ProcessGroup

    @property
    def leader(self) -> int:
        """The rank that writes the pack's logs and files."""
        return self.ranks[0]


def ranks_of(devices: tuple[int, ...], tp: int) -> tuple[int, ...]:
    return tuple(sorted(d * tp + t for d in devices for t in range(tp)))


def pack_groups(plan: Plan, tp: int) -> dict[int, PackGroups]:
    """{pack index: its groups} for the packs this rank belongs to. Collective over the world:
    every rank creates every pack's groups, in plan order (torch.distributed's rule for
    new_group); packs on the same devices share them."""
    world = dist.get_world_size()
    made: dict[tuple[int, ...], tuple] = {}
    mine = {}
    for index, pack in enumerate(plan.packs):
        devices = tuple(sorted(pack.devices))
        ranks = ranks_of(devices, tp)
        if ranks[-1] >= world:
            raise ValueError(f"lora plan: pack {index} needs ranks {list(ranks)}, the world has {world} (tp={tp})")
        if devices not in made:
            dp_groups = [dist.new_group([d * tp + t for d in devices]) for t in range(tp)]
            made[devices] = (dist.new_group(list(ranks)), dp_groups)
        group, dp_groups = made[devices]
        if dist.get_rank() in ranks:
            mine[index] = PackGroups(ranks, group, dp_groups[dist.get_rank() % tp])
    return mine


@contextmanager
def as_world(group: Optional[dist.ProcessGroup]) -> Iterator[None]:
    """Inside, `group` is the default process group of this process (`None`: the world stays):
    default-group collectives and `dist.get_rank()` / `get_world_size()` are the group's. Only
    for calls that never name another group (ranks in named groups are looked up by world
    rank, which is the group's rank in here)."""
    if group is None:
        yield
        return
    world = distributed_c10d._get_default_group()
    # torch's own setter of the default group (init_process_group's); its C++ rank is for logs.
    distributed_c10d._update_default_pg(group)
    try:
        yield
    finally:
        distributed_c10d._update_default_pg(world)
