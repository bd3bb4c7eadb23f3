"""torch.distributed's registration of process groups: read it, and hold more than one world.

torch keeps the registration of groups (the default group, names, rank maps, tags) in one
private object, `distributed_c10d._world`, which every torch.distributed function reads when
called, and group names in a process-wide C++ registry. This module is the one place that
touches them (checked with the torch of `versions.CHECKED["torch_worlds"]`):

- `live_groups()`: the groups torch has registered and not destroyed;
- `default_group_as(group)`: a group stands in as the default group for a block;
- `Registration` and the functions below it: several worlds in one process. `_world` is
  replaced once per process by a `_PerThreadWorld` with the same interface, where a thread
  inside `building_in(registration)` sees that registration and every other thread the running
  one. A process that never builds a world ahead never has its registry replaced.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def live_groups() -> list[dist.ProcessGroup]:
    """The process groups of this thread's world that torch has registered and not destroyed."""
    return list(c10d._world.pg_map)


@contextlib.contextmanager
def default_group_as(group: dist.ProcessGroup) -> Iterator[None]:
    """Inside, `group` is torch's default process group (through torch's own setter, the one
    init_process_group uses; its C++ rank is for logs only)."""
    world = c10d._get_default_group()
    c10d._update_default_pg(group)
    try:
        yield
    finally:
        c10d._update_default_pg(world)


@contextlib.contextmanager
def thread_gathers_over(world: dist.ProcessGroup) -> Iterator[None]:
    """Inside, this thread's `dist.all_gather_object` calls without a group go over `world`;
    other threads keep calling torch's function unchanged. (Rebinds torch's module function:
    code that took it by name before keeps the original.)"""
    original, here = dist.all_gather_object, threading.get_ident()

    def all_gather_object(object_list, obj, group=None):
        if group is None and threading.get_ident() == here:
            group = world
        return original(object_list, obj, group=group)

    dist.all_gather_object = all_gather_object
    try:
        yield
    finally:
        dist.all_gather_object = original


class Registration:
    """One world's registration: what torch's `_World` holds. `group_count` numbers the names
    of the groups created in it."""

    def __init__(self, group_count: int = 0) -> None:
        self.default_pg: Any = None
        self.pg_map: dict = {}
        self.pg_names: dict = {}
        self.pg_group_ranks: dict = {}
        self.pg_backend_config: dict = {}
        self.group_count = group_count
        self.tags_to_pg: dict = {}
        self.pg_to_tag: dict = {}
        self.pg_coalesce_state: dict = {}
        self.comms: list = []

    @classmethod
    def of_torch(cls, world) -> "Registration":
        """The registration torch's own `_World` object holds now (its dicts, not copies)."""
        registration = cls()
        for name in vars(registration):
            setattr(registration, name, getattr(world, name))
        return registration


def _delegate(name: str) -> property:
    def get(self):
        return getattr(self._registration(), name)

    def set(self, value):
        setattr(self._registration(), name, value)

    return property(get, set)


class _PerThreadWorld(c10d._World):
    """torch's world registry, per thread: a thread inside `building_in(registration)` sees that
    registration, every other thread the running world's."""

    def __init__(self, running: Registration) -> None:  # not super().__init__: it would keep state we delegate
        self.running = running
        self._local = threading.local()

    def _registration(self) -> Registration:
        return getattr(self._local, "registration", None) or self.running

    @contextlib.contextmanager
    def within(self, registration: Registration) -> Iterator[None]:
        self._local.registration = registration
        try:
            yield
        finally:
            self._local.registration = None

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
        c10d._world = _PerThreadWorld(Registration.of_torch(c10d._world))
    return c10d._world


def building_in(registration: Registration) -> contextlib.AbstractContextManager:
    """Within the block, this thread's torch.distributed calls act on `registration`'s world."""
    return _per_thread_world().within(registration)


def enter(registration: Registration) -> None:
    """Make `registration` the process's running world. The running world must have been left
    (`leave_running`)."""
    world = _per_thread_world()
    if world.running.default_pg is not None:
        raise RuntimeError("torch worlds: leave the running world before entering another")
    world.running = registration
    c10d._update_default_pg(registration.default_pg)
    for group, name in registration.pg_names.items():  # a torch destroy may have unregistered them
        c10d._unregister_process_group(name)
        c10d._register_process_group(name, group)


def leave_running() -> Registration:
    """Swap the running world for an empty one; returns the world left (still registered in
    torch's name registry until `forget`)."""
    world = _per_thread_world()
    left, world.running = world.running, Registration()
    c10d._update_default_pg(None)
    return left


def forget(registration: Registration) -> list[dist.ProcessGroup]:
    """Unregister every group of `registration` and empty it, without destroying the groups;
    returns their objects, for the caller to drop."""
    groups = list(dict.fromkeys([registration.default_pg, *registration.pg_map]))
    for name in registration.pg_names.values():
        c10d._unregister_process_group(name)
    for field in vars(registration).values():
        if isinstance(field, (dict, list)):
            field.clear()
    registration.default_pg = None
    return [g for g in groups if g is not None]

