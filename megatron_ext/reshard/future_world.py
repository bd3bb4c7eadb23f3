"""A torch.distributed world built before the process enters it.

A worker pool that changes its number of workers leaves one torch world (the default group and
every group made over it) and forms another at the switch. To build the next one while the
current one keeps training, its groups, and the model and optimizer that use them, are made in a
background thread of every rank that will be in it.

torch keeps the registration of groups (the default group, names, rank maps, tags) in one
object, `distributed_c10d._world`, which every torch.distributed function reads when called.
`FutureWorld` replaces it once per process with a `_PerThreadWorld`: the same interface, where
a thread inside `FutureWorld.building()` sees the future world's registration and every other
thread the running one's. So `init_process_group`, `new_group`, `get_rank`, collectives without
a group, and megatron's builders work in the building thread as if the future world were the
only one. `enter()` makes its registration the process's, at the switch.

Group names, which torch also registers process-wide (C++), come from a counter per world; the
future world's counter starts past any the running world can reach, on every rank alike, since
a group's name is its rendezvous key.

This leans on torch's internals (`_World`, `_update_default_pg`, the C++ name registry) as of
the pinned torch; tests/distributed/test_reshard_future_world.py checks it. A process that never
builds a world ahead never has its registry replaced.
"""

from __future__ import annotations

import contextlib
import threading
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, TypeVar

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from megatron_ext.parallel.release import built_or_failure

# Group names of the n-th future world start at n * _NAME_BLOCK.
_NAME_BLOCK = 1 << 20

T = TypeVar("T")


class _Registry:
    """One world's registration: what torch's `_World` holds."""

    def __init__(self) -> None:
        self.default_pg: Any = None
        self.pg_map: dict = {}
        self.pg_names: dict = {}
        self.pg_group_ranks: dict = {}
        self.pg_backend_config: dict = {}
        self.group_count = 0
        self.tags_to_pg: dict = {}
        self.pg_to_tag: dict = {}
        self.pg_coalesce_state: dict = {}
        self.comms: list = []

    @classmethod
    def of_torch(cls, world) -> "_Registry":
        """The registration torch's own `_World` object holds now (its dicts, not copies)."""
        registry = cls()
        for name in vars(registry):
            setattr(registry, name, getattr(world, name))
        return registry


def _delegate(name: str) -> property:
    def get(self):
        return getattr(self._registry(), name)

    def set(self, value):
        setattr(self._registry(), name, value)

    return property(get, set)


class _PerThreadWorld(c10d._World):
    """torch's world registry, per thread: a thread that entered a future world's `building()`
    sees its registration, every other thread the running world's."""

    def __init__(self, running: _Registry) -> None:  # noqa: super().__init__ keeps state we delegate
        self.running = running
        self._local = threading.local()

    def _registry(self) -> _Registry:
        return getattr(self._local, "registry", None) or self.running

    @contextlib.contextmanager
    def within(self, registry: _Registry) -> Iterator[None]:
        self._local.registry = registry
        try:
            yield
        finally:
            self._local.registry = None

    default_pg = _delegate("default_pg")
    pg_map = _delegate("pg_map")
    pg_names = _delegate("pg_names")
    pg_group_ranks = _delegate("pg_group_ranks")
    pg_backend_config = _delegate("pg_backend_config")
    group_count = _delegate("group_count")
    tags_to_pg = _delegate("tags_to_pg")
    pg_to_tag = _delegate("pg_to_tag")
    pg_coalesce_state = _delegate("pg_coalesce_state")
    comms = _delegate("comms")


def _per_thread_world() -> _PerThreadWorld:
    """torch's registry, made per thread (once per process; the running world carries over)."""
    if not isinstance(c10d._world, _PerThreadWorld):
        c10d._world = _PerThreadWorld(_Registry.of_torch(c10d._world))
    return c10d._world


class FutureWorld:
    """The torch world of `size` ranks that `store` rendezvouses, built ahead by this rank
    (`rank`). `number` tells the future worlds of a job apart (the same on every rank)."""

    def __init__(self, store: dist.Store, rank: int, size: int, number: int, backend: str, timeout: timedelta):
        self.rank, self.size = rank, size
        self._registry = _Registry()
        self._registry.group_count = number * _NAME_BLOCK
        self.entered = False
        with self.building():
            dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """Within the block, this thread's torch.distributed calls act on this world."""
        if self.entered:
            raise RuntimeError("future world: already entered; it is the running world now")
        with _per_thread_world().within(self._registry):
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
        world = _per_thread_world()
        if world.running.default_pg is not None:
            raise RuntimeError("future world: leave the running world before entering another")
        world.running = self._registry
        c10d._update_default_pg(self._registry.default_pg)
        for group, name in self._registry.pg_names.items():  # a torch destroy may have unregistered them
            c10d._unregister_process_group(name)
            c10d._register_process_group(name, group)
        self.entered = True

    def dissolve(self) -> list:
        """Forget a world that will not be entered; returns its group objects, to drop."""
        if self.entered:
            return []
        return _forget(self._registry)


def leave_running_world() -> list:
    """Leave the running torch world without waiting for its groups' destructors: torch forgets
    every group of it, and the caller gets the group objects to drop in the background (a gloo
    group's destructor takes tens of ms, release.py)."""
    world = _per_thread_world()
    left, world.running = world.running, _Registry()
    c10d._update_default_pg(None)
    return _forget(left)


def _forget(registry: _Registry) -> list:
    groups = list(dict.fromkeys([registry.default_pg, *registry.pg_map]))
    for name in registry.pg_names.values():
        c10d._unregister_process_group(name)
    for field in vars(registry).values():
        if isinstance(field, (dict, list)):
            field.clear()
    registry.default_pg = None
    return [g for g in groups if g is not None]


