"""The executor's rounds, for the plans of test_reshard_plan's layout pairs and several budgets.

Each rank cuts its own rounds from its own ops and every rank's byte counts: every op of the
plan is carried out exactly once (an op larger than its pair's share as slabs that tile its
box), both ends of an op put it in the same round, no rank sends or receives more than the
budget in a round (so no rank stages more than twice it), and the round count stays near the
busiest rank's bytes over the budget.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from megatron_ext.reshard.execute import local_rounds, peak_bytes, rank_rounds, rounds, traffic
from megatron_ext.reshard.plan import plan, rank_plan

from test_reshard_plan import PAIRS, assert_exact_coverage, assert_sources_held

BUDGETS = [1000, 16 << 10, 256 << 10, 4 << 20, 1 << 40]


@pytest.fixture(scope="module", params=list(PAIRS))
def case(request):
    model, a, b = PAIRS[request.param]
    return model, a, b, plan(model, a, b)


def flat_ops(steps) -> list:
    return [op for step in steps for op in step.ops]


@pytest.mark.parametrize("budget", BUDGETS)
def test_rounds_carry_every_op_once_within_the_budget(case, budget):
    model, a, _, p = case
    steps = rounds(p, budget)
    ops = flat_ops(steps)
    assert sum(op.nbytes for op in ops) == sum(op.nbytes for op in p.ops)
    if budget >= 2 * p.network_bytes:  # every pair's share holds all its bytes
        assert sorted(map(repr, ops)) == sorted(map(repr, p.ops))  # nothing split
    split = dataclasses.replace(p, ops=tuple(ops))
    assert_exact_coverage(split)  # the slabs tile every destination exactly once
    assert_sources_held(model, a, split)  # and lie in what their source holds
    for step in steps:
        assert all(step.sent(r) <= budget and step.received(r) <= budget for r in range(p.world))
    peaks = peak_bytes(p, steps)
    assert set(peaks) == set(range(p.world))
    assert max(peaks.values()) <= 2 * budget


@pytest.mark.parametrize("budget", BUDGETS[1:3])
def test_both_ends_of_an_op_cut_the_same_round_from_their_own_plans(case, budget):
    """Each rank's rounds from its own rank_plan: an op (or slab) is in the same round at its
    source and at its destination, and the ranks' rounds together are the world's."""
    model, a, b, p = case
    everyone = [traffic(p, r) for r in range(p.world)]
    where: dict[str, set] = {}
    for rank in range(p.world):
        mine = rank_rounds(rank_plan(model, a, b, rank), rank, budget, everyone)
        for index, step in enumerate(mine):
            assert all(rank in (op.src, op.dst) for op in step.ops)
            for op in step.ops:
                if not op.local:
                    where.setdefault(repr(op), set()).add(index)
    assert all(len(indices) == 1 for indices in where.values())
    world = {repr(op): i for i, step in enumerate(rounds(p, budget)) for op in step.ops if not op.local}
    assert world == {op: indices.pop() for op, indices in where.items()}


def test_round_count_is_near_the_lower_bound(case):
    """With a budget of every rank's traffic and floor, all ops fit one round; with an eighth
    of the busiest rank's traffic, at least eight rounds and not many more."""
    _, _, _, p = case
    busiest = max(max(p.sent(r), p.received(r)) for r in range(p.world))
    floor = max(max(t.send_floor, t.receive_floor) for t in map(lambda r: traffic(p, r), range(p.world)))
    assert len(rounds(p, busiest + floor)) == 1
    budget = max(busiest // 8, 1)
    assert math.ceil(busiest / budget) <= len(rounds(p, budget)) <= 2 * math.ceil(busiest / budget) + 2


def test_budget_below_one_element_per_peer_is_refused():
    p = plan(*PAIRS["tp2pp2->pp2dp2"])
    with pytest.raises(ValueError, match="below the plan's minimum"):
        rounds(p, 3)


def test_a_plan_of_local_copies_is_one_round_without_a_word_exchanged():
    model, a, _ = PAIRS["tp2->pp2"]
    stay = rank_plan(model, a, a, 1)
    assert local_rounds(stay) == [dataclasses.replace(local_rounds(stay)[0])] and stay.ops
    with pytest.raises(ValueError, match="sends over the network"):
        local_rounds(rank_plan(*PAIRS["tp2->pp2"], 1))
