"""A model's weights or gradients as logical (layout-free) tensors, to compare layouts.

Each rank lists the shards it holds with their boxes in the logical tensor (megatron's sharded
state dict says which); `whole` puts all ranks' lists together.
"""

from __future__ import annotations

import torch

# ((logical key, global index), whole shape, box as (start, stop) pairs, values)
Shard = tuple[tuple, tuple, tuple, torch.Tensor]


def weight_shards(model_chunks) -> list[Shard]:
    """Every weight shard this rank holds."""
    from megatron_ext.models.logical import local_box, local_shards

    return [
        (
            (name.key, name.index),
            tuple(shape),
            tuple((b.start, b.stop) for b in local_box(sh)),
            sh.data.detach().clone().reshape(sh.local_shape),
        )
        for name, shape, sh in local_shards(model_chunks)
    ]


def grad_shards(model_chunks) -> list[Shard]:
    """Every gradient shard this rank holds (megatron DDP's `main_grad`, of the last backward)."""
    params = [p for chunk in model_chunks for p in chunk.parameters()]
    weights = [p.data.clone() for p in params]
    try:
        # The sharded state dict views the parameters: put the gradients there to read them.
        for p in params:
            p.data.copy_(p.main_grad)
        return weight_shards(model_chunks)
    finally:
        for p, w in zip(params, weights):
            p.data.copy_(w)


def whole(shards_of_ranks: list[list[Shard]], what: str) -> dict[tuple, torch.Tensor]:
    """Every logical tensor put together from all ranks' boxes; overlapping boxes (replicas)
    must agree exactly and every element must be held by some rank (`what` names the tensors in
    a failure)."""
    found, conflicts = {}, []
    for shards in shards_of_ranks:
        for name, shape, box, values in shards:
            tensor, seen = found.setdefault(
                name, (torch.full(shape, float("nan")), torch.zeros(shape, dtype=torch.bool))
            )
            region = tuple(slice(a, b) for a, b in box)
            if seen[region].any() and not torch.equal(tensor[region][seen[region]], values[seen[region]]):
                conflicts.append(name)
            tensor[region], seen[region] = values, True
    assert not conflicts, f"{what}: replicas differ in {conflicts}"
    holes = [name for name, (tensor, seen) in found.items() if not seen.all()]
    assert not holes, f"{what}: no rank holds all of {holes}"
    return {name: tensor for name, (tensor, _) in found.items()}
