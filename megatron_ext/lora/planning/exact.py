"""Exact plans for small sweeps: the shortest makespan over rigid packs.

A rigid pack starts all its jobs together on tp x dp devices (`slots` = its size) and holds
them until its last job ends; packs are scheduled on the devices like parallel tasks. Which
subsets to pack, their shapes and their start times are chosen together:
  - `cpsat`: OR-Tools CP-SAT, one optional interval per (subset, shape) that fits in memory,
    exactly one chosen interval per job, a cumulative constraint of capacity = devices;
  - `brute_force`: every set partition x every shape per block x every order of the blocks,
    each order placed by order-preserving list scheduling (a block starts at the earliest time,
    not before the previous block's start, when enough devices are free). Some order yields an
    optimal schedule: place the blocks of an optimal schedule in order of their starts and each
    lands no later than there. Exponential: tiny sweeps and cross-checks only.
Device sets need not be contiguous, so a cumulative schedule always maps onto devices: each
pack takes, at its start, the devices that are free then.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Iterator, Optional, Sequence

from megatron_ext.lora.planning.plan import Pack, Plan
from megatron_ext.lora.planning.problem import Problem, Shape

# CP-SAT works on integers: durations are rounded up to this fraction of the horizon (the jobs
# one after another, at most jobs x makespan), so its plan is optimal to within
# jobs^2 x RESOLUTION of the makespan. Finer grids make the search much slower.
RESOLUTION = 1e-4
# Brute force enumerates partitions x shapes x orders: seconds at 4 jobs, hours at 7.
BRUTE_FORCE_JOBS = 4


def _candidates(problem: Problem, max_jobs: int) -> list[tuple[tuple[str, ...], Shape, float]]:
    names = [j.name for j in problem.jobs]
    if len(names) > max_jobs:
        raise ValueError(f"exact lora planner: {len(names)} jobs; it enumerates subsets, use at most {max_jobs}")
    out = []
    for size in range(1, len(names) + 1):
        for subset in itertools.combinations(names, size):
            jobs = [problem.by_name[n] for n in subset]
            for shape in problem.shapes:
                if problem.fits(jobs, size, shape):
                    out.append((subset, shape, problem.duration(subset, shape, size)))
    return out


def _to_plan(strategy: str, devices: int, starts: list[tuple[float, tuple[str, ...], Shape, float]]) -> Plan:
    """Give each pack, in order of start, the devices that are free earliest (all of them by its
    start in a schedule that respects the device count); the simulator recomputes the times."""
    free_at = [(0.0, d) for d in range(devices)]
    packs = []
    for start, names, (tp, dp), seconds in sorted(starts, key=lambda s: s[0]):
        used = {d for _, d in heapq.nsmallest(tp * dp, free_at)}
        free_at = [f for f in free_at if f[1] not in used] + [(start + seconds, d) for d in used]
        packs.append(Pack(names, tp, dp, len(names), tuple(sorted(used))))
    return Plan(strategy, tuple(packs))


def cpsat(problem: Problem, max_jobs: int = 8, time_limit_s: float = 60.0) -> Plan:
    from ortools.sat.python import cp_model  # optional: ortools (the lora extra)

    candidates = _candidates(problem, max_jobs)
    horizon_s = sum(min(d for n, _, d in candidates if n == (j.name,)) for j in problem.jobs)
    unit = horizon_s * RESOLUTION
    horizon = int(horizon_s / unit) + len(problem.jobs) + 1
    model = cp_model.CpModel()
    chosen, starts, intervals, sizes = [], [], [], []
    makespan = model.NewIntVar(0, horizon, "makespan")
    for i, (_, _, seconds) in enumerate(candidates):
        size = -int(-seconds // unit)  # rounded up: the integer schedule stays feasible in seconds
        x = model.NewBoolVar(f"x{i}")
        start = model.NewIntVar(0, horizon, f"s{i}")
        intervals.append(model.NewOptionalFixedSizeIntervalVar(start, size, x, f"i{i}"))
        model.Add(makespan >= start + size).OnlyEnforceIf(x)
        chosen.append(x)
        starts.append(start)
        sizes.append(size)
    demands = [tp * dp for _, (tp, dp), _ in candidates]
    model.AddCumulative(intervals, demands, problem.hardware.devices)
    # Redundant, but it lets the search prove optimality fast: the chosen packs' device-time
    # fits under devices x makespan.
    model.Add(problem.hardware.devices * makespan >= sum(x * d * size for x, d, size in zip(chosen, demands, sizes)))
    for job in problem.jobs:
        model.AddExactlyOne(x for x, (names, _, _) in zip(chosen, candidates) if job.name in names)
    _hint_one_after_another(model, candidates, chosen, starts, unit)
    model.Minimize(makespan)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_time_in_seconds = time_limit_s
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise RuntimeError(f"exact lora planner: CP-SAT found no plan ({solver.StatusName(status)})")
    picked = [
        (solver.Value(s) * unit, names, shape, seconds)
        for x, s, (names, shape, seconds) in zip(chosen, starts, candidates)
        if solver.Value(x)
    ]
    # A plan CP-SAT has not proven optimal (time limit) says so in its strategy name.
    strategy = "exact" if status == cp_model.OPTIMAL else "exact (not proven optimal)"
    return _to_plan(strategy, problem.hardware.devices, picked)


def _hint_one_after_another(model, candidates, chosen, starts, unit: float) -> None:
    """Start the search from a feasible plan: every job alone on its fastest shape, in turn."""
    best: dict[str, int] = {}
    for i, (names, _, seconds) in enumerate(candidates):
        if len(names) == 1 and (names[0] not in best or seconds < candidates[best[names[0]]][2]):
            best[names[0]] = i
    now = 0
    for i, (_, _, seconds) in enumerate(candidates):
        model.AddHint(chosen[i], i in best.values())
        model.AddHint(starts[i], now if i in best.values() else 0)
        if i in best.values():
            now += -int(-seconds // unit)


def _partitions(items: Sequence[str]) -> Iterator[list[tuple[str, ...]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in _partitions(rest):
        yield [(first,)] + partition
        for i, block in enumerate(partition):
            yield partition[:i] + [(first,) + block] + partition[i + 1 :]


def _list_schedule(devices: int, blocks: Sequence[tuple[Shape, float]]) -> tuple[float, list[float]]:
    free_at = [0.0] * devices
    previous, starts, end = 0.0, [], 0.0
    for (tp, dp), seconds in blocks:
        free_at.sort()
        start = max(previous, free_at[tp * dp - 1])
        free_at[: tp * dp] = [start + seconds] * (tp * dp)
        starts.append(start)
        previous, end = start, max(end, start + seconds)
    return end, starts


def brute_force(problem: Problem, max_jobs: int = 5) -> Plan:
    names = [j.name for j in problem.jobs]
    if len(names) > max_jobs:
        raise ValueError(f"brute-force lora planner: {len(names)} jobs; it is exponential, use at most {max_jobs}")
    best: tuple[float, list] = (float("inf"), [])
    for partition in _partitions(names):
        options = []
        for block in partition:
            jobs = [problem.by_name[n] for n in block]
            options.append([(s, problem.duration(block, s, len(block))) for s in problem.shapes if problem.fits(jobs, len(block), s)])
        for shaped in itertools.product(*options):
            for order in itertools.permutations(range(len(partition))):
                end, starts = _list_schedule(problem.hardware.devices, [shaped[i] for i in order])
                if end < best[0]:
                    best = (end, [(t, partition[i], *shaped[i]) for t, i in zip(starts, order)])
    return _to_plan("brute_force", problem.hardware.devices, best[1])


def solve(problem: Problem) -> Optional[Plan]:
    """CP-SAT when OR-Tools is installed (the `lora` extra), else brute force on at most
    BRUTE_FORCE_JOBS jobs; None when neither applies."""
    try:
        import ortools  # noqa: F401  (optional: whether the lora extra is installed)
    except ImportError:
        return brute_force(problem) if len(problem.jobs) <= BRUTE_FORCE_JOBS else None
    return cpsat(problem)
