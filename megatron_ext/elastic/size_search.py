"""Each budget's sizes chosen by quality before distillation starts.

Fitted to the budgets' costs alone, the router settles on any grid point near each budget's
cost, and points of equal cost differ widely in quality: on SmolLM2-135M at 50 % of the
parameters, one query head per group left a pruned held-out perplexity of 58,336 where another
shape of the same size kept 3,285. As Minitron's candidate search does, every grid point within
the tolerance of a budget's cost is scored here by its loss to the parent on a few calibration
batches (the pruned submodel, before any training), and the router starts from the best one.
"""

from __future__ import annotations

from typing import Callable, Mapping

from megatron_ext.elastic.router import cost_of
from megatron_ext.elastic.space import ElasticSpace, grid_configs


def candidates(
    space: ElasticSpace, grid: Mapping[str, list[int]], budget: float, tolerance: float, cost: str = "params"
) -> list[dict[str, int]]:
    """The grid's submodels whose cost is within `tolerance` (relative) of `budget` times the
    parent's, in the grid's order."""
    full = float(cost_of(space, space.full(), cost))
    return [
        sizes
        for sizes in grid_configs(grid)
        if abs(float(cost_of(space, sizes, cost)) / full - budget) <= tolerance * budget
    ]


def best_sizes(
    space: ElasticSpace,
    grid: Mapping[str, list[int]],
    budgets: list[float],
    tolerance: float,
    loss: Callable[[dict[str, int]], float],
    cost: str = "params",
) -> list[dict[str, int]]:
    """For each budget, the candidate with the lowest `loss` (the first of equal ones). Each
    submodel is scored once, however many budgets it is a candidate of.

    The candidates of a budget are the submodels of `grid` (sizes per axis kind) whose `cost`
    (params, or active_params for MoE) is within `tolerance` (relative) of the budget times the
    parent's, in the grid's order; `loss` scores one submodel's sizes (the pruned submodel's KD
    loss to the parent on calibration batches, in the real-model benchmark). Returns one size
    dict per budget, in the order of `budgets`, where the router then starts. Raises ValueError
    naming the budget when no submodel of the grid is within the tolerance of it.
    """
    scores: dict[tuple, float] = {}
    chosen = []
    for budget in budgets:
        found = candidates(space, grid, budget, tolerance, cost)
        if not found:
            raise ValueError(f"elastic: no submodel of the grid is within {tolerance:.0%} of the {budget:g} budget")
        for sizes in found:
            key = tuple(sorted(sizes.items()))
            if key not in scores:
                scores[key] = loss(sizes)
        chosen.append(min(found, key=lambda s: scores[tuple(sorted(s.items()))]))
    return chosen
