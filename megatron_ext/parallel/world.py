"""A torch.distributed world built before the process enters it.

A worker pool that changes its number of workers leaves one torch world (the default group and
every group made over it) and forms another at the switch. To build the next one while the
current one keeps training, its groups, and the model and optimizer that use them, are made in a
background thread of every rank that will be in it.

torch's registration of groups is per process; `platform/torch_worlds.py` holds several, and a
thread inside `FutureWorld.building()` sees the future world's registration while every other
thread sees the running one's. So `init_process_group`, `new_group`, `get_rank`, collectives
without a group, and megatron's builders work in the building thread as if the future world were
the only one. `enter()` makes its registration the process's, at the switch.

Group names, which torch also registers process-wide, come from a counter per world; the
future world's counter starts past any the running world can reach, on every rank alike, since
a group's name is its rendezvous key. tests/distributed/test_parallel_world.py checks it.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Callable, Iterator, Optional, TypeVar

import torch.distributed as dist

from megatron_ext.parallel.release import built_or_failure
from megatron_ext.platform import torch_worlds

# Group names of the n-th future world start at n * _NAME_BLOCK.
_NAME_BLOCK = 1 << 20

T = TypeVar("T")


class FutureWorld:
    """The torch world of `size` ranks that `store` rendezvouses, built ahead by this rank
    (`rank`). `number` tells the future worlds of a job apart (the same on every rank)."""

    def __init__(self, store: dist.Store, rank: int, size: int, number: int, backend: str, timeout: timedelta):
        self.rank, self.size = rank, size
        self._registration = torch_worlds.Registration(group_count=number * _NAME_BLOCK)
        self.entered = False
        with self.building():
            dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """Within the block, this thread's torch.distributed calls act on this world."""
        if self.entered:
            raise RuntimeError("future world: already entered; it is the running world now")
        with torch_worlds.building_in(self._registration):
            yield

    def build(self, build: Callable[[], T]) -> tuple[Optional[T], Optional[str]]:
        """(`build()` run in this world, None), or (None, what failed). A failure breaks the
        world at once (`built_or_failure`), so that the other ranks' collectives in it fail too
        rather than wait for this rank until the timeout."""

        def in_this_world() -> T:
            with self.building():
                return build()

        return built_or_failure(in_this_world, self.dissolve)

    def enter(self) -> None:
        """Make this world the process's running one, in place of the running world, which the
        caller has left (`leave_running_world`)."""
        torch_worlds.enter(self._registration)
        self.entered = True

    def dissolve(self) -> list:
        """Forget a world that will not be entered; returns its group objects, to drop."""
        if self.entered:
            return []
        return torch_worlds.forget(self._registration)


def leave_running_world() -> list:
    """Leave the running torch world without waiting for its groups' destructors: torch forgets
    every group of it, and the caller gets the group objects to drop in the background (a gloo
    group's destructor takes tens of ms, release.py)."""
    return torch_worlds.forget(torch_worlds.leave_running())
