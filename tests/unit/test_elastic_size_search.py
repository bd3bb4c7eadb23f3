"""Each budget's sizes chosen by quality (size_search.py): the candidates are exactly the grid's
submodels within the tolerance of the budget's cost (brute force over the grid), the chosen one
has the lowest held-out KD loss among them (each scored alone), and the router, started there,
selects it."""

from __future__ import annotations

import torch

from megatron_ext.elastic.distill import CurriculumConfig, Distiller
from megatron_ext.elastic.router import BudgetRouter, RouterConfig
from megatron_ext.elastic.size_search import best_sizes, candidates
from megatron_ext.elastic.space import ElasticSpace
from tests.unit.test_elastic_router import BUDGETS, GRID, batch, relative_cost
from tests.unit.test_elastic_slicing import build_parent, world  # noqa: F401

TOLERANCE = 0.1
VOCAB = 100


def test_sizes_by_quality_are_the_lowest_loss_candidates_and_the_router_starts_there(world):  # noqa: F811
    torch.manual_seed(0)
    teacher = build_parent().eval()
    student = build_parent().eval()
    student.load_state_dict(teacher.state_dict())
    space = ElasticSpace(student)
    router = BudgetRouter(BUDGETS, GRID, RouterConfig(), seed=0)
    distiller = Distiller(space, teacher, router, CurriculumConfig(BUDGETS), VOCAB)
    batches = [batch(1)]
    scored = []

    def loss(sizes: dict) -> float:
        scored.append(sizes)
        return distiller.heldout_kd(student, batches, sizes)

    chosen = best_sizes(space, GRID, BUDGETS, TOLERANCE, loss)
    for budget, sizes in zip(BUDGETS, chosen):
        found = candidates(space, GRID, budget, TOLERANCE)
        everything = [dict(zip(GRID, (h, a, f))) for h in GRID["hidden"] for a in GRID["heads"] for f in GRID["ffn"]]
        assert found == [s for s in everything if abs(relative_cost(space, s) - budget) <= TOLERANCE * budget]
        losses = [distiller.heldout_kd(student, batches, s) for s in found]
        assert sizes == found[losses.index(min(losses))]
    assert len(chosen[1:]) == 2 and len({tuple(s.items()) for s in chosen}) == 3  # distinct: not vacuous
    assert len(scored) == len({tuple(sorted(s.items())) for s in scored})  # each submodel scored once
    assert chosen[0] == {k: max(v) for k, v in GRID.items()}  # the parent itself loses nothing

    distiller.start_router_at(chosen, steps=200)
    assert [router.select(b) for b in range(len(BUDGETS))] == chosen
