"""A torch world built ahead (parallel/world.py): 4 ranks build it, with megatron's groups
of TP2×PP2 in it, while 2 of them keep running collectives in their current world of 2; then
they leave that world and all 4 enter the new one. Every collective's result is checked against
the sum computed from the group's rank list, in both worlds, before and after the switch; a
second world built and dissolved leaves the running one as it was."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from megatron_ext.platform.launch import launch_local

pytestmark = pytest.mark.distributed

TIMEOUT = timedelta(seconds=120)


def _sum_over(group, rank: int) -> float:
    """This rank's value (rank + 1) summed over `group`, by a collective."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([rank + 1.0])
    dist.all_reduce(value, group=group)
    return value.item()


def _expected(group) -> float:
    import torch.distributed as dist

    return sum(r + 1.0 for r in dist.get_process_group_ranks(group))


def _worker() -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.distributed import distributed_c10d as c10d

    from megatron_ext.config.schema import ParallelConfig
    from megatron_ext.platform.launch import prepare_process, rendezvous_store
    from megatron_ext.parallel.world import FutureWorld, leave_running_world
    from megatron_ext.platform.megatron_parallel_state import private_parallel_state
    from megatron_ext.parallel.groups import parallel_state_sizes
    from megatron_ext.parallel.layout import ParallelLayout
    from megatron_ext.training.layout_controller import PreparedLayout

    launch, _ = prepare_process("cpu")
    rank, store = launch.rank, rendezvous_store(launch, TIMEOUT)
    running = rank < 2
    if running:
        dist.init_process_group("gloo", store=dist.PrefixStore("world1", store), rank=rank, world_size=2)
    seen: dict = {"rank": rank}

    def build() -> None:
        world = FutureWorld(dist.PrefixStore("world2", store), rank, 4, 2, "gloo", TIMEOUT)
        with world.building():
            seen["building"] = (dist.get_world_size(), dist.get_rank())
            state = private_parallel_state()
            state.initialize_model_parallel(**parallel_state_sizes(ParallelConfig(tp=2, pp=2)))
            tp = state.get_tensor_model_parallel_group()
            seen["tp_ahead"] = (_sum_over(tp, rank), _expected(tp))
        seen["world"], seen["state"] = world, state

    builder = threading.Thread(target=build)
    builder.start()
    collectives = 0
    while running:  # the current world keeps working meanwhile, until both builders are done
        still = torch.tensor([float(builder.is_alive())])
        dist.all_reduce(still, op=dist.ReduceOp.MAX)
        assert dist.get_world_size() == 2 and _sum_over(None, rank) == 3.0
        collectives += 1
        if still.item() == 0:
            break
    builder.join()
    seen["collectives"] = collectives

    discarded = FutureWorld(dist.PrefixStore("world3", store), rank, 4, 3, "gloo", TIMEOUT)
    with discarded.building():
        names = [c10d._world.pg_names[dist.new_group([0, 1, 2, 3])]]
    discarded.dissolve()
    seen["dissolved_unregistered"] = all(_unregistered(name) for name in names)
    if running:
        seen["old_world_after_dissolve"] = _sum_over(None, rank)
        leave_running_world()
        seen["between_worlds_initialized"] = dist.is_initialized()

    seen["world"].enter()
    PreparedLayout(ParallelLayout(tp=2, pp=2), seen.pop("state"), [], None, None).enter()  # megatron's globals: TP2×PP2 in world 2
    pp = parallel_state.get_pipeline_model_parallel_group()
    seen["entered"] = (dist.get_world_size(), dist.get_rank(), _sum_over(None, rank))
    seen["pp_after"] = (_sum_over(pp, rank), _expected(pp))
    fresh = dist.new_group([0, 1, 2, 3])
    seen["new_group_after"] = _sum_over(fresh, rank)
    del seen["world"]
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return seen


def _unregistered(name: str) -> bool:
    from torch.distributed import distributed_c10d as c10d

    try:
        c10d._resolve_process_group(name)
    except RuntimeError:
        return True
    return False


def test_a_world_built_ahead_is_entered_while_the_running_one_kept_working():
    seen = launch_local(4, _worker, (), "127.0.0.1", 0)
    for rank, s in sorted(seen.items()):
        assert s["building"] == (4, rank)
        assert s["tp_ahead"][0] == s["tp_ahead"][1]  # {0, 1}: 3, {2, 3}: 7
        assert s["dissolved_unregistered"]
        assert s["entered"] == (4, rank, 10.0)
        assert s["pp_after"][0] == s["pp_after"][1]
        assert s["new_group_after"] == 10.0
    for rank in (0, 1):
        assert seen[rank]["collectives"] >= 1
        assert seen[rank]["old_world_after_dissolve"] == 3.0
        assert seen[rank]["between_worlds_initialized"] is False
