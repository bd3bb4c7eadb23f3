"""The PLoRA heuristic's search shortcuts change how fast it plans, never what it plans: on a
table of small sweeps its plan equals the plan of the same heuristic with its local search
trying every neighbour and its list scheduling scanning every device for each pack
and every device group shape a pack could run on kept as an option (references written here
from their definitions), and the shortcuts time fewer groups."""

from __future__ import annotations

import heapq
from typing import Optional

import pytest

from megatron_ext.lora.planning import planner
from megatron_ext.lora.planning.plan import Pack, Plan
from tests.unit.test_lora_planner import SWEEPS, mixed, problem


def improve_trying_every_neighbour(p: planner.Problem, groups, rounds: int):
    """Each round, every move of a job off the group that ends last and every swap of one of
    its jobs with another group's, each timed; the one with the lowest makespan (the first
    found among equals), while that is lower than the current makespan."""
    shape = groups.shape
    jobs = [list(q) for q in groups.jobs]
    ends = [planner._group_end(p, names, shape) for names in jobs]
    for _ in range(rounds):
        worst = max(range(len(ends)), key=ends.__getitem__)
        best: Optional[tuple[float, list, list]] = None
        for name in jobs[worst]:
            for other in range(len(jobs)):
                if other == worst:
                    continue
                changes = [([n for n in jobs[worst] if n != name], jobs[other] + [name])]
                changes += [([q if n == name else n for n in jobs[worst]], [name if n == q else n for n in jobs[other]])
                            for q in jobs[other]]
                for new_worst, new_other in changes:
                    new_jobs = [list(q) for q in jobs]
                    new_jobs[worst], new_jobs[other] = new_worst, new_other
                    new_ends = list(ends)
                    new_ends[worst] = planner._group_end(p, new_worst, shape)
                    new_ends[other] = planner._group_end(p, new_other, shape)
                    if max(new_ends) < max(ends) * (1 - 1e-9) and (best is None or max(new_ends) < best[0]):
                        best = (max(new_ends), new_jobs, new_ends)
        if best is None:
            break
        _, jobs, ends = best
    return planner._Groups(shape, jobs, groups.leftovers)


def _place(free_at: list, n: int, end: float) -> tuple[list, tuple[int, ...]]:
    chosen = heapq.nsmallest(n, free_at)
    devices = tuple(sorted(d for _, d in chosen))
    return [f for f in free_at if f[1] not in devices] + [(end, d) for d in devices], devices


def greedy_scanning(devices: int, options):
    free_at = [(0.0, d) for d in range(devices)]
    placed, makespan = [], 0.0
    for choices in sorted(options, key=lambda o: -min(c[0] for c in o)):
        best = None
        for seconds, queue, slots, (tp, dp) in choices:
            end = max(t for t, _ in heapq.nsmallest(tp * dp, free_at)) + seconds
            if best is None or (end, tp * dp) < best[:2]:
                best = (end, tp * dp, queue, slots, tp, dp)
        end, size, queue, slots, tp, dp = best
        free_at, chosen = _place(free_at, size, end)
        placed.append(Pack(queue, tp, dp, slots, chosen))
        makespan = max(makespan, end)
    return makespan, Plan("planner", tuple(placed))


def list_scanning(devices: int, chosen, order):
    free_at = [(0.0, d) for d in range(devices)]
    placed, ends = [], [0.0] * len(chosen)
    for i in order:
        seconds, queue, slots, (tp, dp) = chosen[i]
        ends[i] = max(t for t, _ in heapq.nsmallest(tp * dp, free_at)) + seconds
        free_at, on = _place(free_at, tp * dp, ends[i])
        placed.append(Pack(queue, tp, dp, slots, on))
    return ends, Plan("planner", tuple(placed))


def allotted_rescanning(devices: int, options):
    """`planner._allotted` with the packs a shape can shorten found anew every round."""
    current = [min(c, key=lambda o: (planner._area(o), o[0])) for c in options]
    best = None
    while True:
        ends, placed = min((planner._list_placed(devices, current, sorted(range(len(current)), key=lambda k: -key(current[k])))
                            for key in (lambda o: o[0], planner._area)), key=lambda c: max(c[0]))
        if best is None or max(ends) < best[0]:
            best = (max(ends), placed)
        shorter = {k: [o for o in options[k] if o[0] < current[k][0]] for k in range(len(current))}
        movable = [k for k in shorter if shorter[k]]
        if not movable:
            return best
        last = max(movable, key=lambda k: (ends[k], current[k][0]))
        current[last] = min(shorter[last], key=lambda o: (planner._area(o), o[0]))


def every_option(options):
    return options


REFERENCES = {"_improve": improve_trying_every_neighbour, "_greedy_placed": greedy_scanning,
              "_list_placed": list_scanning, "_allotted": allotted_rescanning, "_undominated": every_option}

CASES = {**{name: (*sweep, "linear") for name, sweep in SWEEPS.items()},
         **{f"{name}, roofline": (*sweep, "roofline") for name, sweep in SWEEPS.items()},
         "sixteen devices, twenty jobs": (mixed(20), 16, 2, "linear"),
         "sixteen devices, twenty jobs, roofline": (mixed(20), 16, 2, "roofline")}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_heuristic_plans_as_with_every_neighbour_tried_and_every_device_scanned(name, monkeypatch):
    jobs, devices, room, cost = CASES[name]
    fast = problem(jobs, devices, room, cost)
    fast_plan = planner.heuristic(fast)
    for function, reference in REFERENCES.items():
        monkeypatch.setattr(planner, function, reference)
    slow = problem(jobs, devices, room, cost)
    assert fast_plan == planner.heuristic(slow)
    # the shortcuts pass over neighbours that cannot win without timing them
    assert len(fast._chains) <= len(slow._chains)


def test_passing_over_neighbours_that_cannot_win_times_fewer_groups():
    jobs, devices, room, cost = CASES["four devices, twelve jobs"]
    fast, slow = problem(jobs, devices, room, cost), problem(jobs, devices, room, cost)
    for shape in fast.shapes:
        groups = planner._balanced(fast, shape, 1)
        assert planner._improve(fast, groups, 30).jobs == improve_trying_every_neighbour(slow, groups, 30).jobs
    assert len(fast._chains) < len(slow._chains)


def test_on_many_groups_the_local_search_tries_those_that_end_first_and_still_improves():
    jobs = mixed(40)
    fast, slow = problem(jobs, 20, 2), problem(jobs, 20, 2)
    groups = planner._balanced(fast, (1, 1), 1)
    assert len(groups.jobs) > planner.IMPROVE_TARGETS + 1
    start = planner._makespan(fast, groups)
    improved = planner._makespan(fast, planner._improve(fast, groups, 30))
    improve_trying_every_neighbour(slow, groups, 30)
    assert improved < start
    assert len(fast._chains) < len(slow._chains)
