"""The PLoRA planner: which jobs of a sweep to pack, on how many devices with which TP/DP
degree, in what order, so that the whole sweep finishes soonest without exceeding memory.

    problem = Problem(jobs, Hardware(devices=8, memory_bytes=80 * 10**9), memory, cost)
    schedule = plan(problem)          # exact for small sweeps, heuristic for large ones
    print(table(schedule))

The heuristic splits the devices into equal groups of one (tp, dp) shape, gives each group a
queue of jobs by longest-processing-time balancing and lets each group train `slots` jobs at a
time (a finished job's slot goes to the next in its queue). It tries every shape and a range of
slot counts, improves the best plan by moving and swapping jobs off the group that ends last,
reschedules the packs of these plans on mixed shapes (moldable tasks: greedy placement, and
shapes fixed first from the most device-efficient up, then list scheduling), repacks small
sweeps by local search, and keeps the best of that and the baseline strategies (so it is never
worse than them).
Every candidate is timed by the simulator (simulate.py) under the problem's cost model.

The exact solver (exact.py) optimises over rigid packs (all jobs of a pack start together) on
small sweeps; the heuristic's queues can beat it, never the lower bound.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass
from typing import Optional, Sequence

from megatron_ext.lora.planning import exact
from megatron_ext.lora.planning.plan import Pack, Plan
from megatron_ext.lora.planning.problem import Problem, Shape
from megatron_ext.lora.planning.simulate import Schedule, simulate

# Slot counts the heuristic gives a pack (up to its jobs and memory) and packings it balances for.
SLOT_CHOICES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def check_feasible(problem: Problem) -> None:
    """Refuse, before anything runs, a job that does not fit on any device group even alone."""
    usable = problem.hardware.usable_bytes
    problems = []
    for job in problem.jobs:
        need = min(problem.memory.per_device([job], tp, dp).total for tp, dp in problem.shapes)
        if need > usable:
            problems.append(
                f"job {job.name!r} needs {need / 2**30:.2f} GiB per device even alone with its best "
                f"TP/DP degree; a device has {usable / 2**30:.2f} GiB usable"
            )
    if problems:
        raise ValueError("lora sweep cannot fit in memory: " + "; ".join(problems))


def lower_bound(problem: Problem) -> float:
    """No plan ends before its longest job could, trained alone on its best shape: a pass with
    more jobs never takes less time than the job's own pass (cost models are monotone)."""
    return max(
        min(problem.solo_duration(j, s) for s in problem.shapes if problem.fits([j], 1, s)) for j in problem.jobs
    )


# --- baselines ---------------------------------------------------------------------------------


def sequential(problem: Problem) -> Plan:
    """One job at a time on all devices, each with its fastest shape that uses them all."""
    everything = tuple(range(problem.hardware.devices))
    packs = []
    for job in problem.jobs:
        shapes = [s for s in problem.shapes if s[0] * s[1] == problem.hardware.devices and problem.fits([job], 1, s)]
        shapes = shapes or [s for s in problem.shapes if problem.fits([job], 1, s)]
        tp, dp = min(shapes, key=lambda s: problem.solo_duration(job, s))
        packs.append(Pack((job.name,), tp, dp, 1, everything[: tp * dp]))
    return Plan("sequential", tuple(packs))


def per_job(problem: Problem) -> Plan:
    """No packing: each job alone on the fewest devices that hold it (smallest TP), many jobs at
    once, longest first, each on the devices that free up first."""
    free_at = [(0.0, d) for d in range(problem.hardware.devices)]
    packs = []
    jobs = sorted(problem.jobs, key=lambda j: -min(problem.solo_duration(j, s) for s in problem.shapes))
    for job in jobs:
        tp, dp = min((s for s in problem.shapes if problem.fits([job], 1, s)), key=lambda s: (s[0] * s[1], s[0]))
        chosen = heapq.nsmallest(tp * dp, free_at)
        start = max(t for t, _ in chosen)
        end = start + problem.solo_duration(job, (tp, dp))
        devices = tuple(sorted(d for _, d in chosen))
        free_at = [(t, d) for t, d in free_at if d not in devices] + [(end, d) for d in devices]
        packs.append(Pack((job.name,), tp, dp, 1, devices))
    return Plan("per_job", tuple(packs))


def pack_all(problem: Problem) -> Optional[Plan]:
    """Every job in one pack, all at once, on the best shape that holds them all (None: none)."""
    names = tuple(j.name for j in problem.jobs)
    shapes = [s for s in problem.shapes if problem.fits(problem.jobs, len(names), s)]
    if not shapes:
        return None
    tp, dp = min(shapes, key=lambda s: problem.duration(names, s, len(names)))
    return Plan("pack_all", (Pack(names, tp, dp, len(names), tuple(range(tp * dp))),))


BASELINES = {"sequential": sequential, "per_job": per_job, "pack_all": pack_all}


# --- heuristic ---------------------------------------------------------------------------------

# A device group's work: packs (queue, slots) run one after another on the same devices.
Chain = tuple[tuple[tuple[str, ...], int], ...]


@dataclass
class _Groups:
    """Equal device groups of one shape, each with its jobs; `leftovers`: jobs that do not fit
    the shape, run alone afterwards on the fewest devices that hold them."""

    shape: Shape
    jobs: list[list[str]]
    leftovers: tuple[str, ...] = ()

    def plan(self, problem: Problem) -> Plan:
        tp, dp = self.shape
        size = tp * dp
        packs = []
        for g, names in enumerate(self.jobs):
            for queue, slots in _chain(problem, tuple(sorted(names)), self.shape)[1]:
                packs.append(Pack(queue, tp, dp, slots, tuple(range(g * size, (g + 1) * size))))
        for name in self.leftovers:
            fitting = [s for s in problem.shapes if problem.fits([problem.by_name[name]], 1, s)]
            ltp, ldp = min(fitting, key=lambda s: (s[0] * s[1], s[0]))
            packs.append(Pack((name,), ltp, ldp, 1, tuple(range(ltp * ldp))))
        return Plan("planner", tuple(packs))


def _queue_order(problem: Problem, names: Sequence[str], shape: Shape) -> tuple[str, ...]:
    """Longest first, so the last jobs to start are short and the pack's slots end together."""
    return tuple(sorted(names, key=lambda n: (-problem.solo_duration(problem.by_name[n], shape), n)))


def _best_pack(problem: Problem, names: Sequence[str], shape: Shape) -> tuple[float, tuple[str, ...], int]:
    """(time, queue, slots) of the fastest pack of `names` whose slots fit in memory."""
    queue = _queue_order(problem, names, shape)
    jobs = [problem.by_name[n] for n in queue]
    best = (float("inf"), queue, 1)
    for slots in SLOT_CHOICES:
        if slots > len(queue) or (slots > 1 and not problem.fits(jobs, slots, shape)):
            break
        best = min(best, (problem.duration(queue, shape, slots), queue, slots))
    return best


# Shapes whose best balanced plan the local search improves (it dominates the planner's time).
IMPROVED_SHAPES = 3
# Above this many jobs, only the RESHAPED_SHAPES best shapes' balanced plans are rescheduled on
# mixed shapes (each costs a pack-level schedule per shape of each of its packs: at 256 jobs on
# 256 devices, 30 shapes' plans took most of a minute).
RESHAPED_ALL_JOBS = 64
RESHAPED_SHAPES = 4
# Up to this many jobs, the pack-level local search runs too (it is quadratic per round).
REPACKED_JOBS = 12
# The local search moves and swaps the worst group's jobs with at most this many other groups
# (those that end first).
IMPROVE_TARGETS = 16
# Below this many jobs a group's packs may split anywhere in its length-sorted order; above,
# only between sequence lengths (the split search is quadratic in the split points).
FINE_SPLIT_JOBS = 8


def _chain(problem: Problem, names: tuple[str, ...], shape: Shape) -> tuple[float, Chain]:
    """A group's jobs as packs run one after another, fastest first found.

    A pack pads every sample to its longest sequence, so packing short sequences with long ones
    wastes passes: jobs are sorted by length (then by solo time) and cut into contiguous
    ranges, each a pack with its best slot count, the cuts chosen by dynamic programming."""
    key = (names, shape)
    if key in problem._chains:
        return problem._chains[key]
    order = sorted(names, key=lambda n: (-problem.by_name[n].tokens_per_sample, -problem.solo_duration(problem.by_name[n], shape), n))
    lengths = [problem.by_name[n].tokens_per_sample for n in order]
    cuts = [i for i in range(1, len(order)) if len(order) <= FINE_SPLIT_JOBS or lengths[i] != lengths[i - 1]]
    points = [0] + cuts + [len(order)]
    best: dict[int, tuple[float, Chain]] = {0: (0.0, ())}
    for end in points[1:]:
        for begin in (p for p in points if p < end):
            time, queue, slots = _best_pack(problem, order[begin:end], shape)
            total = best[begin][0] + time
            if end not in best or total < best[end][0]:
                best[end] = (total, best[begin][1] + ((queue, slots),))
    problem._chains[key] = best[len(order)] if order else (0.0, ())
    return problem._chains[key]


def _group_end(problem: Problem, names: Sequence[str], shape: Shape) -> float:
    return _chain(problem, tuple(sorted(names)), shape)[0]


def _balanced(problem: Problem, shape: Shape, share: int) -> Optional[_Groups]:
    groups = problem.hardware.devices // (shape[0] * shape[1])
    fitting = [j for j in problem.jobs if problem.fits([j], 1, shape)]
    if not fitting:
        return None
    # Longest processing time first, each job to the group with the least work queued, work
    # being a job's solo time divided by `share`, the jobs it is expected to train next to.
    load = [(0.0, g) for g in range(groups)]
    jobs: list[list[str]] = [[] for _ in range(groups)]
    for job in sorted(fitting, key=lambda j: (-problem.solo_duration(j, shape), j.name)):
        work, g = heapq.heappop(load)
        jobs[g].append(job.name)
        heapq.heappush(load, (work + problem.solo_duration(job, shape) / share, g))
    leftovers = tuple(j.name for j in problem.jobs if j not in fitting)
    return _Groups(shape, jobs, leftovers)


def _makespan(problem: Problem, groups: _Groups) -> float:
    if groups.leftovers:
        return simulate(groups.plan(problem), problem.jobs, problem.hardware.devices, None, problem).makespan
    return max(_group_end(problem, names, groups.shape) for names in groups.jobs)


def _improve(problem: Problem, groups: _Groups, rounds: int) -> _Groups:
    """Move or swap a job off the group that ends last while that lowers the makespan."""
    shape = groups.shape
    jobs = [list(q) for q in groups.jobs]
    ends = [_group_end(problem, names, shape) for names in jobs]
    for _ in range(rounds):
        worst = max(range(len(ends)), key=ends.__getitem__)
        # A neighbour changes two groups; the ends of the others bound its makespan from below,
        # so one that cannot beat the best found so far is passed over before it is timed.
        leading = sorted(range(len(ends)), key=lambda g: -ends[g])[:3]
        limit = max(ends) * (1 - 1e-9)
        best: Optional[tuple[float, int, list[str], list[str], float, float]] = None
        # On many groups only those that end first take the worst group's jobs: each other
        # group costs a timing per move and swap, and a busy one rarely takes a job.
        targets = heapq.nsmallest(IMPROVE_TARGETS, (g for g in range(len(jobs)) if g != worst), key=lambda g: (ends[g], g))
        for other, new_worst, new_other in _neighbours(jobs, worst, sorted(targets)):
            bar = limit if best is None else min(limit, best[0])
            rest = max((ends[g] for g in leading if g != worst and g != other), default=0.0)
            if rest >= bar:
                continue
            worst_end = _group_end(problem, new_worst, shape)
            if worst_end >= bar:
                continue
            other_end = _group_end(problem, new_other, shape)
            if max(rest, worst_end, other_end) < bar:
                best = (max(rest, worst_end, other_end), other, new_worst, new_other, worst_end, other_end)
        if best is None:
            break
        _, other, jobs[worst], jobs[other], ends[worst], ends[other] = best
    return _Groups(shape, jobs, groups.leftovers)


def _neighbours(jobs: list[list[str]], worst: int, others: Sequence[int]):
    """(other group, the worst group's jobs, the other's) after each move of a job off the
    worst group to one of `others` and each swap of one of its jobs with theirs."""
    for name in jobs[worst]:
        for other in others:
            yield other, [n for n in jobs[worst] if n != name], jobs[other] + [name]
            for partner in jobs[other]:
                yield (other, [partner if n == name else n for n in jobs[worst]],
                       [name if n == partner else n for n in jobs[other]])


# One way to run a pack: (seconds, queue, slots, shape).
Option = tuple[float, tuple[str, ...], int, Shape]


def _reshaped(problem: Problem, packs: Sequence[Sequence[str]]) -> Optional[Plan]:
    """The packs scheduled as moldable tasks on mixed shapes, the best of two constructions:
    - greedy: longest first, each on the shape (with its best slot count) and the earliest-free
      devices that finish it soonest; lets a long pack take more devices while short ones share
      the rest, which equal groups cannot;
    - allotted (`_allotted`): shapes fixed first, then list scheduling. Greedy gives every
      short pack all devices (each alone ends soonest there); giving short packs their most
      device-efficient shapes lets them run side by side next to a wide long pack.
    None when a pack fits no shape (padded to its longest sequence, one job may be too many)."""
    options = []
    for names in packs:
        jobs = [problem.by_name[n] for n in names]
        shapes = [s for s in problem.shapes if problem.fits(jobs, 1, s)]
        if not shapes:
            return None
        options.append(_undominated([(*_best_pack(problem, names, s), s) for s in shapes]))
    return min((_greedy_placed(problem.hardware.devices, options), _allotted(problem.hardware.devices, options)),
               key=lambda c: c[0])[1]


def _undominated(options: list[Option]) -> list[Option]:
    """The options no other beats on both time and devices (and ties on neither): neither
    construction ever picks one that another beats (both prefer less time, then fewer devices)."""
    def beaten(o: Option) -> bool:
        return any(b[0] <= o[0] and _size(b) <= _size(o) and (b[0] < o[0] or _size(b) < _size(o)) for b in options)

    return [o for o in options if not beaten(o)]


def _size(option: Option) -> int:
    return option[3][0] * option[3][1]


def _greedy_placed(devices: int, options: Sequence[Sequence[Option]]) -> tuple[float, Plan]:
    """Longest first, each pack on the option that ends it soonest; the makespan and the plan."""
    free = _Free(devices)
    placed, makespan = [], 0.0
    for choices in sorted(options, key=lambda o: -min(c[0] for c in o)):
        best = None
        for seconds, queue, slots, (tp, dp) in choices:
            end = free.ready(tp * dp) + seconds
            if best is None or (end, tp * dp) < (best[0], best[1].size):
                best = (end, Pack(queue, tp, dp, slots, ()))
        end, pack = best
        pack = dataclasses.replace(pack, devices=free.take(pack.size, end))
        placed.append(pack)
        makespan = max(makespan, end)
    return makespan, Plan("planner", tuple(placed))


class _Free:
    """When each device frees up, kept sorted by (time, device): the `n` that free up first are
    the first `n` (what `heapq.nsmallest(n, ...)` would pick), without a scan per pack."""

    def __init__(self, devices: int) -> None:
        self.order = [(0.0, d) for d in range(devices)]

    def ready(self, n: int) -> float:
        """When the `n` devices that free up first are all free."""
        return self.order[n - 1][0]

    def take(self, n: int, until: float) -> tuple[int, ...]:
        """Those `n` devices, busy until `until`, in device order."""
        chosen = tuple(sorted(d for _, d in self.order[:n]))
        self.order = sorted(self.order[n:] + [(until, d) for d in chosen])
        return chosen


def _list_placed(devices: int, chosen: Sequence[Option], order: Sequence[int]) -> tuple[list[float], Plan]:
    """Packs of fixed shapes placed in `order`, each on the devices that free up first; the end
    of each pack (in `chosen` order) and the plan."""
    free = [(0.0, d) for d in range(devices)]  # a heap of (free at, device)
    placed, ends = [], [0.0] * len(chosen)
    for i in order:
        seconds, queue, slots, (tp, dp) = chosen[i]
        picked = [heapq.heappop(free) for _ in range(tp * dp)]
        ends[i] = picked[-1][0] + seconds
        on = tuple(sorted(d for _, d in picked))
        for d in on:
            heapq.heappush(free, (ends[i], d))
        placed.append(Pack(queue, tp, dp, slots, on))
    return ends, Plan("planner", tuple(placed))


def _area(option: Option) -> float:
    """Device-seconds."""
    return option[0] * option[3][0] * option[3][1]


def _allotted(devices: int, options: Sequence[Sequence[Option]]) -> tuple[float, Plan]:
    """Shapes fixed before placing (the two-phase scheme of moldable task scheduling): every
    pack starts on its most device-efficient shape (fewest device-seconds); then, again and
    again, of the packs that a shape can shorten the one that ends last moves to the most
    efficient such shape, and all are placed anew, longest first and (a wide long pack
    first lets the narrow ones fill in after it) largest area first. The best placement seen."""
    current = [min(choices, key=lambda o: (_area(o), o[0])) for choices in options]
    fastest = [min(o[0] for o in choices) for choices in options]
    best: Optional[tuple[float, Plan]] = None
    while True:
        ends, placed = min(
            (_list_placed(devices, current, sorted(range(len(current)), key=lambda k: -key(current[k])))
             for key in (lambda o: o[0], _area)),
            key=lambda c: max(c[0]),
        )
        if best is None or max(ends) < best[0]:
            best = (max(ends), placed)
        movable = [k for k in range(len(current)) if current[k][0] > fastest[k]]
        if not movable:
            return best
        last = max(movable, key=lambda k: (ends[k], current[k][0]))
        current[last] = min((o for o in options[last] if o[0] < current[last][0]), key=lambda o: (_area(o), o[0]))


def _repacked(problem: Problem, plan: Plan, rounds: int) -> Plan:
    """Local search over which jobs share a pack, each partition scheduled by `_reshaped`:
    move a job to another pack or to a pack of its own while that lowers the makespan."""

    def makespan(p: Optional[Plan]) -> float:
        return float("inf") if p is None else simulate(p, problem.jobs, problem.hardware.devices, None, problem).makespan

    packs = [tuple(sorted(p.jobs)) for p in plan.packs]
    best_plan = _reshaped(problem, packs)
    best = makespan(best_plan)
    for _ in range(rounds):
        found = None
        for i, source in enumerate(packs):
            for name in source:
                rest = [p for k, p in enumerate(packs) if k != i] + ([tuple(n for n in source if n != name)] if len(source) > 1 else [])
                for j in range(len(rest) + 1):
                    moved = [tuple(sorted(p + (name,))) if k == j else p for k, p in enumerate(rest)]
                    if j == len(rest):
                        moved.append((name,))
                    candidate = _reshaped(problem, moved)
                    seconds = makespan(candidate)
                    if seconds < best * (1 - 1e-9) and (found is None or seconds < found[0]):
                        found = (seconds, moved, candidate)
        if found is None:
            break
        best, packs, best_plan = found
    return best_plan


def heuristic(problem: Problem, rounds: int = 30) -> Plan:
    """For each shape, the best balanced split of the jobs over equal groups (over the packing
    the balance expects); the IMPROVED_SHAPES best of those locally improved; the packs of
    all of them (on large sweeps, of the RESHAPED_SHAPES best) and every job alone also
    rescheduled on mixed shapes; the best."""

    def makespan(p: Optional[Plan]) -> float:
        return float("inf") if p is None else simulate(p, problem.jobs, problem.hardware.devices, None, problem).makespan

    best_per_shape: dict[Shape, tuple[float, _Groups]] = {}
    for shape in problem.shapes:
        for share in SLOT_CHOICES:
            groups = _balanced(problem, shape, share)
            if groups is not None:
                candidate = (_makespan(problem, groups), groups)
                if shape not in best_per_shape or candidate[0] < best_per_shape[shape][0]:
                    best_per_shape[shape] = candidate
            if share >= len(problem.jobs):
                break
    leading = sorted(best_per_shape.values(), key=lambda c: c[0])[:IMPROVED_SHAPES]
    plans = [_improve(problem, groups, rounds).plan(problem) for _, groups in leading]
    # Pack sets to reschedule on mixed shapes: those plans', the balanced plans', and every
    # job alone; on small sweeps the best of them repacked by local search.
    balanced = list(best_per_shape.values())
    if len(problem.jobs) > RESHAPED_ALL_JOBS:
        balanced = sorted(balanced, key=lambda c: c[0])[:RESHAPED_SHAPES]
    sources = plans + [groups.plan(problem) for _, groups in balanced]
    reshaped = [_reshaped(problem, [p.jobs for p in s.packs]) for s in sources]
    reshaped.append(_reshaped(problem, [(j.name,) for j in problem.jobs]))
    reshaped = [p for p in reshaped if p is not None]
    if reshaped and len(problem.jobs) <= REPACKED_JOBS:
        reshaped.append(_repacked(problem, min(reshaped, key=makespan), rounds))
    plans += reshaped
    return min(plans, key=makespan)


def plan(problem: Problem, exact_limit: int = 6) -> Schedule:
    """The planner: exact on sweeps of at most `exact_limit` jobs, the heuristic beyond, and
    never worse than a baseline strategy. Refuses a sweep that cannot fit before planning.

    `problem` holds the jobs (LoRA settings, batch, sequence length, steps), the devices, the
    memory model and the cost model that times a pack. Candidate plans: the heuristic's
    (packs of jobs on device groups of a TP / DP shape, improved by local search), the exact
    solver's on small sweeps (CP-SAT with the `lora` extra, else brute force), and the baselines
    of `BASELINES` (sequential, per_job, pack_all); each is simulated and the shortest makespan
    wins. Returns its Schedule: the plan, when each job and pack starts and ends, and each
    device's peak memory. Raises ValueError, before planning, when a job does not fit on any
    device group even alone.
    """
    check_feasible(problem)
    plans = [heuristic(problem)]
    if len(problem.jobs) <= exact_limit:
        plans += [p for p in (exact.solve(problem),) if p is not None]
    plans += [p for p in (make(problem) for make in BASELINES.values()) if p is not None]
    schedules = [simulate(p, problem.jobs, problem.hardware.devices, problem.memory, problem) for p in plans]
    best = min(schedules, key=lambda s: s.makespan)
    return Schedule(
        Plan(f"planner ({best.plan.strategy})" if best.plan.strategy != "planner" else "planner", best.plan.packs),
        best.jobs,
        best.packs,
        best.peak_bytes,
    )
