"""DPP checkpointing ILP: on small instances its choice is optimal against brute force over
every diagonal assignment (feasibility judged by the simulator's independent memory replay);
planned steps never exceed the budget in the simulator; too small a budget is refused with the
minimum feasible budget, and that minimum is indeed feasible."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from megatron_ext.dpp.planning import recompute
from megatron_ext.dpp.planning.chunking import chunk_batch
from megatron_ext.dpp.planning.plan import StepPlan
from megatron_ext.dpp.planning.planner import plan_step, plan_step_info
from megatron_ext.dpp.planning.recompute import BudgetTooSmall
from megatron_ext.dpp.planning.schedule import longest_first, one_f_one_b, units, with_recompute
from megatron_ext.dpp.planning.simulate import memory_peaks, simulate
from tests.unit._dpp_cases import TOY

# name -> (lengths, k, pp, layers per stage, where the budget lies between no and full recompute)
CASES = {
    "pp2, split + packed": ([60, 20, 10], 2, 2, 2, 0.5),
    "pp2, tight": ([60, 20, 10], 2, 2, 2, 0.15),
    "pp3, one long sequence": ([90, 10], 3, 3, 2, 0.5),
    "pp2, three layers, loose": ([50, 30, 25, 5], 2, 2, 3, 0.8),
    "pp3, packed only": ([20, 15, 10, 5], 1, 3, 2, 0.4),
}


def _group(lengths, k, pp):
    chunks = chunk_batch(lengths, TOY, k)
    order = longest_first(units(chunks), lambda c: TOY.layer_forward_s(chunks[c]))
    return chunks, one_f_one_b(order, pp)


def _peak(chunks, lengths, group, rec, layers):
    plan = StepPlan(len(group.ops), tuple(lengths), chunks, (with_recompute(group, rec),))
    return max(memory_peaks(plan, TOY, layers))


def _case(name):
    """A case's batch, group and a budget `where` of the way from full to no recompute."""
    lengths, k, pp, per_stage, where = CASES[name]
    chunks, group = _group(lengths, k, pp)
    layers = (per_stage,) * pp
    cells = [(p, c) for p in range(pp) for c in range(len(chunks))]
    low = _peak(chunks, lengths, group, {x: per_stage for x in cells}, layers)
    high = _peak(chunks, lengths, group, {}, layers)
    return lengths, pp, per_stage, chunks, group, layers, cells, low + where * (high - low)


@pytest.mark.parametrize("name", CASES)
def test_ilp_is_optimal_against_brute_force(name):
    lengths, pp, per_stage, chunks, group, layers, cells, budget = _case(name)
    # Brute force over the diagonal variables (the definition: backward position k on stage p
    # shares C[k + pp - 1 - p]); cost = sum of C_j times the slowest layer on the diagonal.
    bwd = [o.chunk for o in group.ops[0] if o.kind == "B"]
    diag = {(p, c): bwd.index(c) + pp - 1 - p for p, c in cells}
    n_var = len(bwd) + pp - 1
    weight = [max(TOY.layer_forward_s(chunks[c]) for (p, c), j in diag.items() if j == jj) for jj in range(n_var)]
    best = np.inf
    for C in itertools.product(range(per_stage + 1), repeat=n_var):
        cost = sum(w * x for w, x in zip(weight, C))
        if cost < best and _peak(chunks, lengths, group, {x: C[diag[x]] for x in cells}, layers) <= budget:
            best = cost
    sol = recompute.solve(group, chunks, lengths, TOY, layers, budget, mip_rel_gap=0.0)
    assert sol is not None
    assert sol.cost_s == pytest.approx(best, rel=1e-9)
    assert _peak(chunks, lengths, group, sol.recompute, layers) <= budget
    assert all(sol.recompute[(p, c)] == sol.recompute[(p2, c2)] for (p, c) in cells for (p2, c2) in cells
               if diag[(p, c)] == diag[(p2, c2)])


@pytest.mark.parametrize("seed,pp", [(0, 2), (1, 4), (2, 3)])
def test_planned_steps_never_exceed_the_budget_in_the_simulator(seed, pp):
    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in np.minimum(rng.lognormal(4.0, 1.2, 16).astype(int) + 1, 600)]
    layers = (2,) * pp
    states = TOY.model_state_bytes(2, True, True)
    planned = 0
    for budget in (states + 3e6, states + 1e7):
        try:
            plan, info = plan_step_info(lengths, TOY, pp, budget, "dpp", layers=layers, k_candidates=(1, 2, 4, 8))
        except BudgetTooSmall:
            continue
        planned += 1
        sim = simulate(plan, TOY, layers, budget)
        assert not any(sim.oom), (budget, sim.peak_bytes)
    assert planned


def test_too_small_budget_names_a_minimum_that_is_feasible():
    lengths, layers = [400, 120, 60, 30, 30, 8], (2, 2)
    states = TOY.model_state_bytes(2, True, True)
    with pytest.raises(BudgetTooSmall, match="minimum feasible budget") as err:
        plan_step(lengths, TOY, 2, states + 1000, "dpp", layers=layers)
    minimum = err.value.min_budget_bytes
    assert minimum > states + 1000
    plan = plan_step(lengths, TOY, 2, minimum, "dpp", layers=layers)
    assert max(simulate(plan, TOY, layers).peak_bytes) <= minimum


def test_model_states_alone_over_budget_is_refused_before_planning():
    with pytest.raises(BudgetTooSmall, match="model states alone"):
        plan_step([10, 20], TOY, 2, 1000.0, "dpp", layers=(2, 2))


@pytest.mark.parametrize("name", CASES)
def test_trim_leaves_each_stage_the_least_recompute_its_memory_needs(name):
    lengths, pp, _, chunks, group, layers, cells, budget = _case(name)
    ilp = recompute.solve(group, chunks, lengths, TOY, layers, budget, mip_rel_gap=0.0).recompute
    trimmed = recompute.trim(group, chunks, lengths, TOY, layers, budget, ilp)
    assert all(trimmed[x] <= ilp[x] for x in cells)

    def peaks(rec):
        return memory_peaks(StepPlan(pp, tuple(lengths), chunks, (with_recompute(group, rec),)), TOY, layers)

    assert max(peaks(trimmed)) <= budget
    # Minimal, judged by the simulator's own memory replay: one layer less anywhere breaks its stage.
    for p, c in cells:
        if trimmed[(p, c)]:
            assert peaks({**trimmed, (p, c): trimmed[(p, c)] - 1})[p] > budget, (p, c)
    time = lambda rec: simulate(StepPlan(pp, tuple(lengths), chunks, (with_recompute(group, rec),)), TOY, layers).iter_s  # noqa: E731
    assert time(trimmed) <= time(ilp)


def test_trim_spares_the_last_stage_what_only_the_first_needs():
    # The diagonal ILP gives the last stage the first stage's counts, though it holds one chunk
    # fewer in flight; here it needs none at all.
    lengths, pp, _, chunks, group, layers, cells, budget = _case("pp2, three layers, loose")
    ilp = recompute.solve(group, chunks, lengths, TOY, layers, budget, mip_rel_gap=0.0).recompute
    trimmed = recompute.trim(group, chunks, lengths, TOY, layers, budget, ilp)
    assert sum(ilp[(pp - 1, c)] for c in range(len(chunks))) > 0
    assert all(trimmed[(pp - 1, c)] == 0 for c in range(len(chunks)))
    assert [trimmed[(0, c)] for c in range(len(chunks))] == [ilp[(0, c)] for c in range(len(chunks))]
