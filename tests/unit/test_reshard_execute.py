"""The executor's rounds, for the plans of test_reshard_plan's layout pairs and several budgets.

Rounds are a pure function of (plan, budget): every op of the plan is carried out exactly once
and in plan order (an op larger than the budget as consecutive slabs that tile its box), no rank
sends or receives more than the budget in a round, and so no rank stages more than twice it.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from megatron_ext.reshard.boxes import contains, numel
from megatron_ext.reshard.execute import peak_bytes, rounds
from megatron_ext.reshard.plan import plan

from test_reshard_plan import PAIRS, assert_exact_coverage, assert_sources_held

BUDGETS = [1000, 16 << 10, 256 << 10, 4 << 20, 1 << 40]


@pytest.fixture(scope="module", params=list(PAIRS))
def case(request):
    model, a, b = PAIRS[request.param]
    return model, a, plan(model, a, b)


def flat_ops(steps) -> list:
    return [op for step in steps for op in step.ops]


def assert_plan_order_tiled(p, ops) -> None:
    """`ops` is the plan's ops in order, each one as consecutive parts that tile its box."""
    parts = iter(ops)
    for op in p.ops:
        covered = 0
        while covered < numel(op.box):
            part = next(parts)
            assert dataclasses.replace(part, box=op.box, nbytes=op.nbytes) == op
            assert contains(op.box, part.box)
            assert part.nbytes * numel(op.box) == op.nbytes * numel(part.box)
            covered += numel(part.box)
        assert covered == numel(op.box)
    assert next(parts, None) is None


@pytest.mark.parametrize("budget", BUDGETS)
def test_rounds_carry_every_op_once_in_plan_order_within_the_budget(case, budget):
    model, a, p = case
    steps = rounds(p, budget)
    ops = flat_ops(steps)
    assert_plan_order_tiled(p, ops)
    if budget >= max(op.nbytes for op in p.ops):
        assert ops == list(p.ops)  # nothing split: the plan's own ops (checked there)
    else:
        split = dataclasses.replace(p, ops=tuple(ops))
        assert_exact_coverage(split)  # the slabs tile every destination exactly once
        assert_sources_held(model, a, split)  # and lie in what their source holds
    for step in steps:
        assert all(step.sent(r) <= budget and step.received(r) <= budget for r in range(p.world))
    peaks = peak_bytes(p, steps)
    assert set(peaks) == set(range(p.world))
    assert max(peaks.values()) <= 2 * budget


@pytest.mark.parametrize("budget", BUDGETS[2:])
def test_a_round_closes_only_when_the_next_op_would_overflow_it(case, budget):
    """Next-fit: each round but the last is full for the source or destination of the op that
    opens the next one; so no round could have been merged with its successor's first op."""
    _, _, p = case
    steps = rounds(p, budget)
    for step, following in zip(steps, steps[1:]):
        first = next(op for op in following.ops if not op.local)
        sent, received = step.sent(first.src), step.received(first.dst)
        assert max(sent, received) + first.nbytes > budget


def test_round_count_is_near_the_lower_bound_for_a_large_budget(case):
    """With a budget above every rank's traffic, all ops fit one round; with a smaller one the
    count is at least the busiest rank's traffic over the budget."""
    _, _, p = case
    busiest = max(max(p.sent(r), p.received(r)) for r in range(p.world))
    assert len(rounds(p, busiest)) == 1
    budget = max(busiest // 8, 1)
    assert len(rounds(p, budget)) >= math.ceil(busiest / budget)


def test_budget_below_one_element_is_refused():
    p = plan(*PAIRS["tp2pp2->pp2dp2"])
    with pytest.raises(ValueError, match="below the plan's minimum"):
        rounds(p, 3)

