"""The process groups a plan's packs train in: each pack at its own TP degree, packs on separate
ranks at the same time.

A plan's device is one rank. A pack of `tp x dp` devices splits its ranks (ascending) into TP
groups of `tp` consecutive ones, like megatron's layouts (TP innermost), and DP groups of the
ranks at the same TP position. Per pack and rank:
  - `group`: every rank of the pack (the runtime's "did any rank fail" votes, checkpoints),
  - `dp_group`: the ranks of the pack at this rank's TP position (the adapter gradient sums),
  - `model_groups`: what megatron's model is built on (its `pg_collection`): the rank's TP
    group, and a group of the rank alone for pipeline, context and embedding parallelism.
megatron's global parallel_state stays at TP=1 meanwhile and describes no pack: the base
(base.py), its loss (loss.py), the LoRA wrappers and the per-job optimizers all take the
pack's TP group from the model. Packs whose TP groups are the same on a rank share one
`model_groups`, so that rank can keep their base.

Every rank runs the packs it belongs to in plan order. A pack's ranks have all finished every
earlier pack they share a rank with, so the earliest unfinished pack always has all its ranks
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
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_ext.lora.planning.plan import Pack, Plan
from megatron_ext.platform.torch_worlds import default_group_as

Ranks = tuple[int, ...]


@dataclass(frozen=True)
class PackGroups:
    ranks: Ranks  # every rank of the pack, ascending
    group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    model_groups: ProcessGroupCollection

    @property
    def leader(self) -> int:
        """The rank that writes the pack's logs and files."""
        return self.ranks[0]


def tp_ranks(pack: Pack) -> list[Ranks]:
    """The pack's TP groups: its ranks, ascending, in runs of `tp`."""
    ranks = sorted(pack.devices)
    return [tuple(ranks[i : i + pack.tp]) for i in range(0, len(ranks), pack.tp)]


def dp_ranks(pack: Pack) -> list[Ranks]:
    """The pack's DP groups: its ranks at each TP position."""
    ranks = sorted(pack.devices)
    return [tuple(ranks[t :: pack.tp]) for t in range(pack.tp)]


def pack_groups(plan: Plan) -> dict[int, PackGroups]:
    """{pack index: its groups} for the packs this rank belongs to. Collective over the world:
    every rank creates every pack's groups, in plan order (torch.distributed's rule for
    new_group); a set of ranks gets one group, whichever packs use it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    made: dict[Ranks, dist.ProcessGroup] = {}

    def group(ranks: Ranks) -> dist.ProcessGroup:
        if ranks not in made:
            made[ranks] = dist.new_group(list(ranks))
        return made[ranks]

    alone = [group((r,)) for r in range(world)][rank]
    collections: dict[Ranks, ProcessGroupCollection] = {}
    mine = {}
    for index, pack in enumerate(plan.packs):
        ranks = tuple(sorted(pack.devices))
        if ranks[-1] >= world:
            raise ValueError(f"lora plan: pack {index} needs ranks {list(ranks)}, the world has {world}")
        whole = group(ranks)
        tps, dps = tp_ranks(pack), dp_ranks(pack)
        for some in tps + dps:  # every rank creates every group
            group(some)
        if rank not in ranks:
            continue
        tp = next(t for t in tps if rank in t)
        dp = next(d for d in dps if rank in d)
        if tp not in collections:
            collections[tp] = ProcessGroupCollection(tp=made[tp], pp=alone, cp=alone, embd=alone)
        mine[index] = PackGroups(ranks, whole, made[dp], collections[tp])
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
    with default_group_as(group):
        yield
