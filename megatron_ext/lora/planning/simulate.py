"""Execute a sweep plan under a cost model: when each job starts and ends, the makespan, and
the memory each device holds at its fullest.

The simulation is event driven. Inside a pack, every packed step trains one micro-batch of
each active job and takes `cost.pass_time(active jobs)` (a Problem's counts each pass of a step
split by a pass cap); between two events (a job finishing) the active set is fixed, so the time
to the next event is (fewest remaining steps) x step time. Memory is evaluated on every active
set that actually occurs, in slot order, independently of the bound the planner used to size
the pack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from megatron_ext.lora.job import LoraJob
from megatron_ext.lora.planning.costmodel import CostModel
from megatron_ext.lora.planning.memory import MemoryModel
from megatron_ext.lora.planning.plan import Pack, Plan
from megatron_ext.lora.planning.workload import replica_work


@dataclass(frozen=True)
class JobRun:
    job: str
    pack: int
    slot: int
    start: float
    end: float


@dataclass(frozen=True)
class PackRun:
    start: float
    end: float
    peak_bytes: int  # on each device of the pack


@dataclass(frozen=True)
class Schedule:
    plan: Plan
    jobs: tuple[JobRun, ...]
    packs: tuple[PackRun, ...]
    peak_bytes: tuple[int, ...]  # per device, over the whole sweep

    @property
    def makespan(self) -> float:
        return max((r.end for r in self.packs), default=0.0)


def run_pack(
    pack: Pack, jobs: dict[str, LoraJob], start: float, memory: Optional[MemoryModel], cost: CostModel
) -> tuple[list[tuple[str, int, float, float]], float, int]:
    """(job, slot, start, end) of each job of the pack, its end and its peak bytes per device
    (0 without a memory model: the planner's timing runs skip it)."""
    queue = list(pack.jobs)
    free_slots = list(range(pack.slots))
    active: dict[str, tuple[int, int, float]] = {}  # job -> (slot, passes left, start)
    runs, now, peak = [], start, 0
    while queue or active:
        while queue and free_slots:
            name = queue.pop(0)
            active[name] = (free_slots.pop(0), replica_work(jobs[name], pack.dp).passes, now)
        # In slot order, as the runtime packs them: a pass cap splits a step in that order.
        members = [jobs[n] for n in sorted(active, key=lambda n: active[n][0])]
        if memory is not None:
            peak = max(peak, memory.per_device(members, pack.tp, pack.dp).total)
        passes = min(left for _, left, _ in active.values())
        now += passes * cost.pass_time(members, pack.tp, pack.dp)
        for name, (slot, left, began) in list(active.items()):
            if left == passes:
                runs.append((name, slot, began, now))
                free_slots.append(slot)
                del active[name]
            else:
                active[name] = (slot, left - passes, began)
        free_slots.sort()
    return runs, now, peak


def simulate(
    plan: Plan, jobs: Sequence[LoraJob], devices: int, memory: Optional[MemoryModel], cost: CostModel
) -> Schedule:
    by_name = {j.name: j for j in jobs}
    plan.check(list(by_name), devices)
    free_at = [0.0] * devices
    peak = [0] * devices
    job_runs, pack_runs = [], []
    for index, pack in enumerate(plan.packs):
        start = max(free_at[d] for d in pack.devices)
        runs, end, pack_peak = run_pack(pack, by_name, start, memory, cost)
        job_runs += [JobRun(name, index, slot, s, e) for name, slot, s, e in runs]
        pack_runs.append(PackRun(start, end, pack_peak))
        for d in pack.devices:
            free_at[d] = end
            peak[d] = max(peak[d], pack_peak)
    return Schedule(plan, tuple(job_runs), tuple(pack_runs), tuple(peak))
