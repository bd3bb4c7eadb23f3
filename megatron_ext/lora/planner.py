"""The PLoRA planner: which jobs of a sweep to pack, on how many devices with which TP/DP
degree, in what order, so that the whole sweep finishes soonest without exceeding memory.

    problem = Problem(jobs, Hardware(devices=8, memory_bytes=80 * 10**9), memory, cost)
    schedule = plan(problem)          # exact for small sweeps, heuristic for large ones
    print(table(schedule))

The heuristic splits the devices into equal groups of one (tp, dp) shape, gives each group a
queue of jobs by longest-processing-time balancing and lets each group train `slots` jobs at a
time (a finished job's slot goes to the next in its queue). It tries every shape and a range of
slot counts, improves the best plan by moving and swapping jobs off the group that ends last,
and keeps the best of that and the baseline strategies (so it is never worse than them).
Every candidate is timed by the simulator (simulate.py) under the problem's cost model.

The exact solver (exact.py) optimises over rigid packs (all jobs of a pack start together) on
small sweeps; the heuristic's queues can beat it, never the lower bound.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass
from typing import Optional, Sequence

from megatron_ext.lora.costmodel import CostModel
from megatron_ext.lora.job import LoraJob
from megatron_ext.lora.memory import Hardware, MemoryModel
from megatron_ext.lora.plan import Pack, Plan
from megatron_ext.lora.simulate import Schedule, run_pack, simulate
from megatron_ext.lora.workload import padded_length, tp_divides

Shape = tuple[int, int]  # (tp, dp)

# Slot counts the heuristic tries per shape (capped by memory and the number of jobs).
SLOT_CHOICES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


@dataclass(frozen=True)
class Problem:
    jobs: tuple[LoraJob, ...]
    hardware: Hardware
    memory: MemoryModel
    cost: CostModel
    max_tp: int = 8  # TP stays inside a node
    max_dp: int = 1 << 20

    def __post_init__(self) -> None:
        object.__setattr__(self, "jobs", tuple(self.jobs))
        names = [j.name for j in self.jobs]
        if len(set(names)) != len(names):
            raise ValueError(f"lora sweep: duplicate job names {sorted({n for n in names if names.count(n) > 1})}")
        if not self.jobs:
            raise ValueError("lora sweep: no jobs")

    @functools.cached_property
    def shapes(self) -> tuple[Shape, ...]:
        """(tp, dp) degrees, powers of two, that the model splits evenly and the devices hold."""
        powers = [2**i for i in range(self.hardware.devices.bit_length()) if 2**i <= self.hardware.devices]
        return tuple(
            (tp, dp)
            for tp in powers
            if tp <= self.max_tp and tp_divides(self.memory.shapes, tp)
            for dp in powers
            if tp * dp <= self.hardware.devices and dp <= self.max_dp
        )

    def fits(self, jobs: Sequence[LoraJob], slots: int, shape: Shape) -> bool:
        return pack_memory_bound(self.memory, jobs, slots, shape) <= self.hardware.usable_bytes

    def solo_duration(self, job: LoraJob, shape: Shape) -> float:
        return self.duration((job.name,), shape, 1)

    def duration(self, names: Sequence[str], shape: Shape, slots: int) -> float:
        """Time a pack of this queue takes from its start to its last job's end."""
        key = (tuple(names), shape, slots)
        if key not in self._durations:
            pack = Pack(key[0], shape[0], shape[1], slots, tuple(range(shape[0] * shape[1])))
            self._durations[key] = run_pack(pack, self.by_name, 0.0, self.memory, self)[1]
        return self._durations[key]

    def pass_time(self, jobs: Sequence[LoraJob], tp: int, dp: int) -> float:
        """The cost model's pass time, remembered: the heuristic meets the same sets often."""
        key = (tuple(j.name for j in jobs), tp, dp)
        if key not in self._pass_times:
            self._pass_times[key] = self.cost.pass_time(jobs, tp, dp)
        return self._pass_times[key]

    @functools.cached_property
    def _durations(self) -> dict:
        return {}

    @functools.cached_property
    def _pass_times(self) -> dict:
        return {}

    @functools.cached_property
    def by_name(self) -> dict[str, LoraJob]:
        return {j.name: j for j in self.jobs}


def pack_memory_bound(memory: MemoryModel, jobs: Sequence[LoraJob], slots: int, shape: Shape) -> int:
    """Bytes per device that no `slots` jobs of `jobs` active together can exceed: the base, the
    largest adapters and the largest activations, all padded to the queue's longest sequence."""
    tp, dp = shape
    seq = padded_length(jobs)
    adapters = sorted((memory.adapter_bytes(j, tp) for j in jobs), reverse=True)[:slots]
    activations = sorted((memory.activation_bytes([j], tp, dp, seq) for j in jobs), reverse=True)[:slots]
    return memory.base_bytes(tp) + sum(adapters) + sum(activations)


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


@dataclass
class _Groups:
    """Equal device groups of one shape, each with a job queue and a slot count."""

    shape: Shape
    queues: list[list[str]]
    slots: list[int]

    def plan(self) -> Plan:
        tp, dp = self.shape
        size = tp * dp
        packs = tuple(
            Pack(tuple(q), tp, dp, s, tuple(range(g * size, (g + 1) * size)))
            for g, (q, s) in enumerate(zip(self.queues, self.slots))
            if q
        )
        return Plan("planner", packs)


def _queue_order(problem: Problem, names: list[str], shape: Shape) -> list[str]:
    """Longest first, so the last jobs to start are short and the group's slots end together."""
    return sorted(names, key=lambda n: -problem.solo_duration(problem.by_name[n], shape))


def _slots_that_fit(problem: Problem, names: list[str], shape: Shape, wanted: int) -> int:
    jobs = [problem.by_name[n] for n in names]
    slots = min(wanted, len(names))
    while slots > 1 and not problem.fits(jobs, slots, shape):
        slots -= 1
    return slots


def _group_end(problem: Problem, queue: list[str], shape: Shape, slots: int) -> float:
    return problem.duration(tuple(_queue_order(problem, queue, shape)), shape, slots) if queue else 0.0


def _balanced(problem: Problem, shape: Shape, slots: int) -> Optional[_Groups]:
    groups = problem.hardware.devices // (shape[0] * shape[1])
    jobs = [j for j in problem.jobs if problem.fits([j], 1, shape)]
    if len(jobs) < len(problem.jobs):
        return None
    # Longest processing time first, each job to the group with the least work queued, work
    # being a job's solo time shared by the slots it trains next to.
    share = min(slots, max(1, len(jobs) // groups))
    load = [(0.0, g) for g in range(groups)]
    queues: list[list[str]] = [[] for _ in range(groups)]
    for job in sorted(jobs, key=lambda j: -problem.solo_duration(j, shape)):
        work, g = heapq.heappop(load)
        queues[g].append(job.name)
        heapq.heappush(load, (work + problem.solo_duration(job, shape) / share, g))
    fitted = [_slots_that_fit(problem, q, shape, slots) if q else 1 for q in queues]
    return _Groups(shape, [_queue_order(problem, q, shape) for q in queues], fitted)


def _makespan(problem: Problem, groups: _Groups) -> float:
    return max(_group_end(problem, q, groups.shape, s) for q, s in zip(groups.queues, groups.slots))


def _improve(problem: Problem, groups: _Groups, rounds: int) -> _Groups:
    """Move or swap a job off the group that ends last while that lowers the makespan; also try
    one slot more or less there."""
    shape = groups.shape
    ends = [_group_end(problem, q, shape, s) for q, s in zip(groups.queues, groups.slots)]
    for _ in range(rounds):
        worst = max(range(len(ends)), key=ends.__getitem__)
        best: Optional[tuple[float, list[list[str]], list[int]]] = None
        for candidate in _neighbours(groups, worst):
            queues, slots, touched = candidate
            slots = list(slots)
            for g in touched:
                slots[g] = _slots_that_fit(problem, queues[g], shape, slots[g]) if queues[g] else 1
            new_ends = list(ends)
            for g in touched:
                new_ends[g] = _group_end(problem, queues[g], shape, slots[g])
            if max(new_ends) < max(ends) - 1e-9 and (best is None or max(new_ends) < best[0]):
                best = (max(new_ends), queues, slots)
        if best is None:
            break
        _, queues, slots = best
        groups = _Groups(shape, [_queue_order(problem, q, shape) for q in queues], slots)
        ends = [_group_end(problem, q, shape, s) for q, s in zip(groups.queues, groups.slots)]
    return groups


def _neighbours(groups: _Groups, worst: int):
    queues, slots = groups.queues, groups.slots
    for delta in (-1, 1):
        if slots[worst] + delta >= 1:
            changed = list(slots)
            changed[worst] += delta
            yield queues, changed, (worst,)
    for name in queues[worst]:
        for other in range(len(queues)):
            if other == worst:
                continue
            moved = [list(q) for q in queues]
            moved[worst].remove(name)
            moved[other].append(name)
            yield moved, slots, (worst, other)
            for partner in queues[other]:
                swapped = [list(q) for q in queues]
                swapped[worst][swapped[worst].index(name)] = partner
                swapped[other][swapped[other].index(partner)] = name
                yield swapped, slots, (worst, other)


def heuristic(problem: Problem, rounds: int = 30) -> Plan:
    """The best equal-group plan over shapes and slot counts, locally improved."""
    candidates = []
    for shape in problem.shapes:
        for slots in SLOT_CHOICES:
            if slots > len(problem.jobs):
                break
            groups = _balanced(problem, shape, slots)
            if groups is not None:
                candidates.append((_makespan(problem, groups), groups))
    candidates.sort(key=lambda c: c[0])
    improved = [_improve(problem, groups, rounds) for _, groups in candidates[:3]]
    return min(improved, key=lambda g: _makespan(problem, g)).plan()


def plan(problem: Problem, exact_limit: int = 6) -> Schedule:
    """The planner: exact on sweeps of at most `exact_limit` jobs, the heuristic beyond, and
    never worse than a baseline strategy. Refuses a sweep that cannot fit before planning."""
    check_feasible(problem)
    from megatron_ext.lora import exact

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
