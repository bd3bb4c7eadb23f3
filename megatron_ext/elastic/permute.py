"""The one-time reorder that makes every submodel a prefix of the parent.

Each axis moves its units into falling-importance order (within groups where it is grouped) in
every tensor it touches, in place. The network computes the same function afterwards: a
permutation of channels applied to a producer's outputs and the same permutation to every
consumer's inputs cancels (RMSNorm is permutation-equivariant, SwiGLU acts element-wise, a head
is a head wherever it sits inside its query group).
"""

from __future__ import annotations

import torch

from megatron_ext.elastic.axes import Axis


@torch.no_grad()
def reorder(axes: list[Axis]) -> dict[str, list[int]]:
    """Permute every axis by its importance order; returns the orders applied (for the record:
    index i of the new model is unit order[i] of the old)."""
    orders = {}
    for axis in axes:
        order = axis.order()
        axis.permute(order)
        orders[axis.name] = order.tolist()
    return orders
