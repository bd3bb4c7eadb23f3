"""DPP schedule: plan-driven 1F1B over units of dependent chunks. The simulator runs every case
to the end (no op waits forever), its timeline respects every dependency (checked here from the
events, independently of how the simulator orders them), and the grouping DP equals brute force."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from megatron_ext.dpp.planning.plan import Chunk, Group, Op, Segment, StepPlan
from megatron_ext.dpp.planning.schedule import group_dp, longest_first, one_f_one_b, units
from megatron_ext.dpp.planning.simulate import Deadlock, PlanError, check_plan, simulate
from tests.unit._dpp_cases import TOY


def _batch(unit_sizes: list[int]) -> tuple[list[int], tuple[Chunk, ...]]:
    """One sequence per unit: m slices of 10 tokens (a packed chunk when m == 1)."""
    lengths, chunks = [], []
    for seq, m in enumerate(unit_sizes):
        lengths.append(10 * m)
        for j in range(m):
            chunks.append(Chunk(len(chunks), "packed" if m == 1 else "split", (Segment(seq, 10 * j, 10),)))
    return lengths, tuple(chunks)


# name -> (unit sizes in data order, pp)
CASES = {
    "plain 1F1B, pp4": ([1] * 6, 4),
    "fewer chunks than stages": ([1, 1], 4),
    "one long sequence": ([5], 3),
    "mixed, short first in data order": ([1, 1, 3, 1, 2, 4, 1], 4),
    "mixed, pp2": ([2, 1, 3, 1, 1], 2),
    "pp1": ([3, 1, 2], 1),
    "long units only, pp3": ([3, 3, 3], 3),
}


@pytest.mark.parametrize("name", CASES)
def test_1f1b_runs_to_the_end_and_respects_dependencies(name):
    sizes, pp = CASES[name]
    lengths, chunks = _batch(sizes)
    order = longest_first(units(chunks), lambda c: TOY.layer_forward_s(chunks[c]))
    plan = StepPlan(pp, tuple(lengths), chunks, (one_f_one_b(order, pp),))
    layers = (1,) * pp
    check_plan(plan, layers)
    sim = simulate(plan, TOY, layers)
    ev = {(e.kind, e.chunk, e.stage): e for e in sim.events}
    assert len(ev) == 2 * len(chunks) * pp
    seq_of = {c.id: c.segments[0].seq for c in chunks}
    for (kind, c, p), e in ev.items():
        if kind == "F" and p > 0:
            assert e.start >= ev[("F", c, p - 1)].end
        if kind == "B":
            assert e.start >= (ev[("B", c, p + 1)].end if p < pp - 1 else ev[("F", c, p)].end)
            later = [d for d in seq_of if seq_of[d] == seq_of[c] and d > c]
            assert all(e.start >= ev[("B", d, p)].end for d in later)  # slices backward in reverse
            assert all(e.start >= ev[("F", d, p)].end for d in later)
        if kind == "F":
            earlier = [d for d in seq_of if seq_of[d] == seq_of[c] and d < c]
            assert all(e.start >= ev[("F", d, p)].end for d in earlier)
    for p in range(pp):  # one op at a time per stage
        spans = sorted((e.start, e.end) for e in sim.events if e.stage == p)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))
    # chunks in flight on stage p never exceed the longest unit + pp - 1 - p
    for p, ops in enumerate(plan.groups[0].ops):
        live = peak = 0
        for o in ops:
            live += 1 if o.kind == "F" else -1
            peak = max(peak, live)
        assert peak <= min(len(chunks), max(sizes) + pp - 1 - p)


def test_crossed_orders_deadlock_in_the_simulator():
    lengths, chunks = _batch([1, 1])
    stage0 = (Op("F", 0), Op("B", 0), Op("F", 1), Op("B", 1))
    stage1 = (Op("F", 0), Op("F", 1), Op("B", 1), Op("B", 0))
    plan = StepPlan(2, tuple(lengths), chunks, (Group((stage0, stage1)),))
    with pytest.raises(PlanError, match="same chunk order"):
        check_plan(plan, (1, 1))
    with pytest.raises(Deadlock):
        simulate(plan, TOY, (1, 1), check=False)


@pytest.mark.parametrize("bad", ["slices backward in order", "missing backward", "recompute beyond layers", "token twice"])
def test_check_plan_rejects(bad):
    lengths, chunks = _batch([2])
    ops = [Op("F", 0), Op("F", 1), Op("B", 1), Op("B", 0)]
    if bad == "slices backward in order":
        ops = [Op("F", 0), Op("F", 1), Op("B", 0), Op("B", 1)]
    elif bad == "missing backward":
        ops = ops[:-1]
    elif bad == "recompute beyond layers":
        ops[0] = Op("F", 0, 3)
    elif bad == "token twice":
        chunks = (chunks[0], Chunk(1, "split", (Segment(0, 5, 15),)))
    plan = StepPlan(1, tuple(lengths), chunks, (Group((tuple(ops),)),))
    with pytest.raises(PlanError):
        check_plan(plan, (2,))


def _brute_groups(n: int, cost, max_groups: int | None) -> float:
    best = math.inf
    for cuts in itertools.product([0, 1], repeat=n - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        if max_groups is not None and len(bounds) - 1 > max_groups:
            continue
        best = min(best, sum(cost(i, j) for i, j in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("max_groups", [None, 1, 2, 3])
def test_group_dp_equals_brute_force(seed, max_groups):
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    table = {(i, j): (math.inf if rng.random() < 0.25 else rng.uniform(0, 10)) for i in range(n) for j in range(i + 1, n + 1)}
    total, ranges = group_dp(n, lambda i, j: table[(i, j)], max_groups)
    assert total == pytest.approx(_brute_groups(n, lambda i, j: table[(i, j)], max_groups))
    if total < math.inf:
        assert ranges[0][0] == 0 and ranges[-1][1] == n and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert sum(table[r] for r in ranges) == pytest.approx(total)
        assert max_groups is None or len(ranges) <= max_groups


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_short_chunks_after_the_long_units_run_with_plain_1f1b_in_flight_counts(pp):
    # A long sequence of 6 slices, then single-chunk units: once the long unit's backwards are
    # done, stage p holds at most pp - p chunks, as plain 1F1B does (not 6 + pp - 1 - p).
    lengths, chunks = _batch([6] + [1] * 12)
    order = longest_first(units(chunks), lambda c: TOY.layer_forward_s(chunks[c]))
    group = one_f_one_b(order, pp)
    plan = StepPlan(pp, tuple(lengths), chunks, (group,))
    check_plan(plan, (1,) * pp)
    simulate(plan, TOY, (1,) * pp)
    for p, ops in enumerate(group.ops):
        live, backwards = set(), 0
        for o in ops:
            if o.kind == "F":
                live.add(o.chunk)
            else:
                live.discard(o.chunk)
                backwards += 1
            if backwards >= 6 + 5:  # past the long unit and the 5 backwards that drain its lead
                assert len(live) <= pp - p, (p, o, sorted(live))
